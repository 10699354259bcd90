"""What ``Fp32Functions`` (``AMPPrecision(fp32_functions=...)``) costs: per step and per torch call.

Part 1, a training step: forward and backward of a small transformer encoder (``--layers``
``nn.TransformerEncoderLayer`` with GELU, a linear head) under ``torch.autocast`` in bf16 (or
``--dtype float16``), three ways: no mode (what ``fp32_functions=()`` runs), the mode with two
registered functions the model never calls (``torch.sigmoid``, ``torch.erf``: pure pass-through),
and the mode with two it calls in every layer (``F.layer_norm``, ``F.gelu``: those run in fp32).
The step count of torch calls the mode sees is counted once, so the overhead per seen call follows.

Part 2, one call: ``torch.relu`` on a 4x4 tensor, timed in a loop of ``--calls`` calls, three ways:
no mode, the mode passing it through, the mode running it in fp32 (registered).

All cases are timed interleaved in one run (``_common.measure``) with pinned torch threads;
ratios are against the no-mode case of the same run: "ratio" of the medians, "best ratio" of
the fastest samples (the least disturbed by other processes on a shared machine).

    python benchmarks/fp32_functions.py                  # table
    python benchmarks/fp32_functions.py --json out.json  # table + JSON
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from _common import Case, environment, format_table, measure, median_ms, write_json
from torch import nn
from torch.nn import functional as F

from amp_plugin.fp32_policy import Fp32Functions

FULL = {"layers": 2, "d_model": 128, "seq": 64, "batch": 16, "calls": 2000, "repeats": 15, "warmup": 3}
QUICK = {"layers": 1, "d_model": 32, "seq": 8, "batch": 2, "calls": 200, "repeats": 2, "warmup": 1}
STEP_MODES: dict[str, tuple[Callable[..., Any], ...] | None] = {
    "no mode": None,
    "mode, registered not called": (torch.sigmoid, torch.erf),
    "mode, registered called": (F.layer_norm, F.gelu),
}
CALL_MODES: dict[str, tuple[Callable[..., Any], ...] | None] = {
    "no mode": None,
    "mode, pass-through": (torch.sigmoid,),
    "mode, registered": (torch.relu,),
}


class Counting(Fp32Functions):
    """``Fp32Functions`` that counts the torch calls it sees."""

    seen = 0

    def __torch_function__(self, func: Any, *rest: Any, **kwargs: Any) -> Any:
        Counting.seen += 1
        return super().__torch_function__(func, *rest, **kwargs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {value}")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="autocast dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, steadier)")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, few repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.layers, args.d_model, args.seq, args.batch, args.calls, args.repeats, args.threads) < 1:
        parser.error("every size, --repeats and --threads must be >= 1")
    return args


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.d_model, 4, 2 * args.d_model, dropout=0.0, activation="gelu",
                                       batch_first=True)  # fmt: skip
    return nn.Sequential(nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
                         nn.Linear(args.d_model, 1))  # fmt: skip


def _region(functions: tuple[Callable[..., Any], ...] | None) -> Any:
    return nullcontext() if functions is None else Fp32Functions(functions)  # fp32_functions=(): no mode


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, x = _model(args), torch.randn(args.batch, args.seq, args.d_model)

    def step(functions: tuple[Callable[..., Any], ...] | None) -> None:
        with torch.autocast("cpu", dtype=dtype), _region(functions):
            loss = model(x).float().square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    small = torch.randn(4, 4, dtype=dtype)

    def calls(functions: tuple[Callable[..., Any], ...] | None) -> None:
        with torch.autocast("cpu", dtype=dtype), _region(functions):
            for _ in range(args.calls):
                torch.relu(small)

    with torch.autocast("cpu", dtype=dtype), Counting(STEP_MODES["mode, registered called"] or ()):
        model(x).float().square().mean()  # the forward's calls; backward runs in C++ and is not seen
    seen_per_step = Counting.seen
    cases = [Case(f"step: {name}", lambda f=f: step(f)) for name, f in STEP_MODES.items()]
    cases += [Case(f"call: {name}", lambda f=f: calls(f)) for name, f in CALL_MODES.items()]
    samples = measure(cases, device="cpu", warmup=args.warmup, repeats=args.repeats)
    ms = {name: median_ms(s) for name, s in samples.items()}
    rows, results = [], {}
    for group, modes in (("step", STEP_MODES), ("call", CALL_MODES)):
        base = ms[f"{group}: no mode"]
        for name in modes:
            key = f"{group}: {name}"
            extra_us = 1e3 * (ms[key] - base) / (seen_per_step if group == "step" else args.calls)
            per = f"{1e3 * ms[key] / args.calls:.2f} us/call" if group == "call" else f"{ms[key]:.2f} ms/step"
            best = min(samples[key]) / min(samples[f"{group}: no mode"])
            extra = "-" if name == "no mode" else f"{extra_us:+.2f}"
            rows.append([key, per, f"{ms[key] / base:.3f}", f"{best:.3f}", extra])
            results[key] = {"median_ms": ms[key], "ratio": ms[key] / base, "best_ratio": best,
                            "extra_us_per_seen_call": extra_us,
                            "samples_ms": samples[key]}  # fmt: skip
        rows.append([])
    params = sum(p.numel() for p in model.parameters())
    print(f"Fp32Functions overhead: CPU autocast {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"{args.repeats} interleaved rounds (median)")  # fmt: skip
    print(f"step: {args.layers}-layer encoder, d_model {args.d_model}, {params / 1e3:.0f}k params, batch "
          f"{args.batch}x{args.seq}; the mode sees {seen_per_step} torch calls per forward")  # fmt: skip
    print(f"call: torch.relu on a 4x4 tensor, {args.calls} calls per sample\n")
    print(format_table(["case", "time", "ratio", "best ratio", "extra us per seen call"], rows[:-1]))
    if args.json:
        config = {k: getattr(args, k) for k in (*FULL, "dtype", "threads", "quick")}
        write_json(args.json, {
            "benchmark": "fp32_functions", "environment": environment("cpu"), "config": config,
            "seen_calls_per_forward": seen_per_step, "results": results,
        })  # fmt: skip


if __name__ == "__main__":
    main()
