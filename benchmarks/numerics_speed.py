"""What stochastic rounding costs: ``stochastic_round`` against a plain ``.to(dtype)``.

One case per target dtype (bfloat16, float16) and method, on a float32 tensor of ``--size``
elements drawn once (normal, so every case sees the same mix of binades). ``.to(dtype)`` is
round-to-nearest, the baseline measured in the same run; ``stochastic_round`` draws its random
bits from a seeded generator. The table gives milliseconds per million elements (the median of
the interleaved repeats, see ``_common.measure``) and the ratio to the baseline.

    python benchmarks/numerics_speed.py                  # table
    python benchmarks/numerics_speed.py --json out.json  # table + JSON
"""

from __future__ import annotations

import argparse

import torch
from _common import Case, default_device, environment, format_table, measure, median_ms, write_json

from amp_plugin.numerics import stochastic_round

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device())
    parser.add_argument("--size", type=int, default=4_000_000, help="elements per call (default 4M)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="256K elements, 3 repeats")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    size, repeats = (2**18, 3) if args.quick else (args.size, args.repeats)
    x = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    cases = []
    for name, dtype in DTYPES.items():
        cases.append(Case(f"{name} .to(dtype)", lambda d=dtype: x.to(d)))
        cases.append(Case(f"{name} stochastic_round", lambda d=dtype: stochastic_round(x, d, generator=g)))
    samples = measure(cases, device=args.device, warmup=2, repeats=repeats)
    per_m = {name: median_ms(s) * 1e6 / size for name, s in samples.items()}
    rows, results = [], []
    for name in DTYPES:
        base = per_m[f"{name} .to(dtype)"]
        for method in (".to(dtype)", "stochastic_round"):
            ms = per_m[f"{name} {method}"]
            rows.append([f"{name} {method}", f"{ms:.3f}", f"{ms / base:.1f}x"])
            results.append({"dtype": name, "method": method, "ms_per_million": ms, "ratio": ms / base})
    print(f"float32 -> half, {size:,} elements on {args.device}, {torch.get_num_threads()} thread(s), "
          f"median of {repeats} repeats")  # fmt: skip
    print(format_table(["case", "ms / 1M elements", "vs .to(dtype)"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(args.device), "size": size, "results": results,
                               "samples_ms": samples})  # fmt: skip


if __name__ == "__main__":
    main()
