"""One read of the gradients for their L2 norm: the Triton kernel against torch's and Apex's norms.

A GPU measurement outside the report (``benchmarks/report.py`` does not run it): it is how the
Triton kernel of ``amp_plugin.kernels._triton`` and its tiling were chosen, and how to check them
on another GPU. For each gradient layout (a list of tensors of one dtype), timed interleaved:

* copy: one read+write copy of the gradients (``torch._foreach_copy_``), the bandwidth yardstick;
* foreach: ``torch._foreach_norm`` and the total over its per-tensor norms (torch's own clip recipe);
* amp_C: Apex's ``multi_tensor_l2norm`` (where Apex's ``amp_C`` imports and the device is CUDA);
* triton CHUNK/BLOCK/WARPS: the Triton sum of squares with that tiling (where Triton imports and
  the device is CUDA); ``--tilings`` names several, the first being the one the code uses.

Each read is also checked against an fp64 sum (relative error in the table). On a CPU only copy and
foreach run: the smoke run of the test suite.

    python benchmarks/gpu/norm_read.py --device cuda --json norm_read.json
    python benchmarks/gpu/norm_read.py --quick     # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
import torch
from _common import Case, default_device, environment, format_table, measure, median_ms, write_json

from amp_plugin._imports import apex_available
from amp_plugin.kernels import _triton

# (label, elements in all, tensors, dtype)
LAYOUTS = [
    ("400M fp32 / 100", 400_000_000, 100, torch.float32),
    ("100M fp32 / 100", 100_000_000, 100, torch.float32),
    ("400M bf16 / 100", 400_000_000, 100, torch.bfloat16),
    ("1M fp32 / 300", 1_000_000, 300, torch.float32),
]
QUICK_LAYOUTS = [
    ("200k fp32 / 20", 200_000, 20, torch.float32),
    ("30k bf16 / 30", 30_000, 30, torch.bfloat16),
]
TILINGS = f"{_triton._CHUNK}/{_triton._BLOCK}/{_triton._WARPS},65536/2048/8,32768/2048/8,16384/1024/4"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=default_device(), choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="small layouts, few repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 30; --quick 3)")
    parser.add_argument("--tilings", default=TILINGS, help="CHUNK/BLOCK/WARPS,... (the first: the code's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here. HINT: leave --device out (the CPU).")
    given = args.tilings
    try:
        args.tilings = [tuple(int(v) for v in t.split("/")) for t in given.split(",")]
    except ValueError:
        args.tilings = []
    if not args.tilings or any(len(t) != 3 for t in args.tilings):
        parser.error(f"--tilings {given!r}: expected CHUNK/BLOCK/WARPS[,...], e.g. 65536/1024/4.")
    return args


def _tiled(tiling: tuple[int, int, int], grads: list[torch.Tensor]) -> Callable[[], object]:
    def read() -> object:
        saved = _triton._CHUNK, _triton._BLOCK, _triton._WARPS
        _triton._CHUNK, _triton._BLOCK, _triton._WARPS = tiling
        try:
            return _triton.sum_of_squares(grads).sqrt()
        finally:
            _triton._CHUNK, _triton._BLOCK, _triton._WARPS = saved

    return read


def reads(grads: list[torch.Tensor], tilings: Sequence[tuple[int, int, int]]) -> dict[str, Callable[[], Any]]:
    """Each way to read ``grads`` for their norm that this machine has, by name."""
    out: dict[str, Callable[[], Any]] = {"foreach": lambda: _foreach_total(grads)}
    if grads[0].is_cuda and apex_available():
        out["amp_C"] = _amp_c_read(grads)
    if _triton.usable(grads):
        for tiling in tilings:
            out["triton " + "/".join(map(str, tiling))] = _tiled(tiling, grads)
    return out


def _foreach_total(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))


def _amp_c_read(grads: list[torch.Tensor]) -> Callable[[], Any]:
    """``multi_tensor_l2norm`` itself (the backend's ``norm`` would route to Triton where it imports)."""
    import amp_C  # present: apex_available() said so
    from apex.multi_tensor_apply import multi_tensor_applier

    flag = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
    return lambda: multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    repeats = args.repeats or (3 if args.quick else 30)
    results: dict[str, Any] = {}
    for label, elements, tensors, dtype in layouts:
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(elements // tensors, generator=gen) * 1e-3 for _ in range(tensors)]
        grads = [g.to(args.device, dtype) for g in grads]
        copies = [torch.empty_like(g) for g in grads]
        truth = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        ways = reads(grads, args.tilings)
        errors = {name: abs(float(read()) - truth) / truth for name, read in ways.items()}
        cases = [Case("copy", lambda dst=copies, src=grads: torch._foreach_copy_(dst, src))]
        cases += [Case(name, read) for name, read in ways.items()]
        samples = measure(cases, device=args.device, warmup=3, repeats=repeats)
        ms = {name: median_ms(s) for name, s in samples.items()}
        x_copy = {name: ms[name] / ms["copy"] for name in ms}
        results[label] = {"ms": ms, "rel_error_vs_fp64": errors, "x_copy": x_copy}
        del grads, copies
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment(args.device)
    results = run(args)
    print(f"norm_read: one read of the gradients for their L2 norm ({env['date']})")
    print(f"  device   {env['device']} ({env['device_name']}), torch {env['torch']}")
    print("  ms       median of the timed repeats, a layout's reads interleaved; x copy: ms / copy's ms")
    if args.device != "cuda":
        print("  note     amp_C and Triton run on CUDA only: this run times torch's reads")
    rows = []
    for label, res in results.items():
        for name, ms in res["ms"].items():
            error = res["rel_error_vs_fp64"].get(name)
            shown = "" if error is None else f"{error:.1e}"
            rows.append([label, name, f"{ms:.3f}", f"{res['x_copy'][name]:.2f}", shown])
        rows.append([])
    print(format_table(["gradients", "read", "ms", "x copy", "rel. error"], rows[:-1]))
    if args.json:
        write_json(args.json, {"environment": env, "tilings": args.tilings, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
