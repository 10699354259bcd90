"""Training steps/s in Lightning Fabric: amp_plugin.lightning.fabric.AMPPrecision vs Fabric's own plugins.

Each row trains the same model with the same data under both plugins, in paired rounds: a
round times ``--steps`` optimizer steps (forward, ``fabric.backward``, optionally
``fabric.clip_gradients``, ``optimizer.step``, ``zero_grad``) with each plugin, the order
alternating. The reported ratio is the median over rounds of AMPPrecision's steps/s over
MixedPrecision's in the same round (above 1: AMPPrecision is faster). fp16 rows drive a
``LossScaler`` against a ``torch.amp.GradScaler``; bf16 rows have no scaler, so they measure
the autocast and step plumbing and the guard's check alone. ``bf16-true`` rows hold the weights
in bf16 and compare against Fabric's ``HalfPrecision`` (no check at all): the cost of the guard
on pure-bf16 training. The scale never grows while timing (growth interval far beyond the run),
and no step overflows.

Run ``python benchmarks/fabric_speed.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import Case, default_device, environment, format_table, measure, median_ms, write_json
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
from torch import nn

from amp_plugin import LossScaler
from amp_plugin.lightning.fabric import AMPPrecision

GROWTH_INTERVAL = 1_000_000_000  # the scale stays put while timing
MODELS = {"tiny": (32, 2, 16), "small": (512, 4, 64)}  # width, layers, batch
FULL = {"steps": 20, "rounds": 15, "warmup": 3}
QUICK = {"steps": 5, "rounds": 3, "warmup": 1}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    precisions = ("16-mixed", "bf16-mixed", "bf16-true")
    add("--precisions", nargs="+", choices=precisions, default=list(precisions))
    add("--steps", type=int, help=f"optimizer steps per timed sample (default {FULL['steps']})")
    add("--rounds", type=int, help=f"paired timed rounds per row (default {FULL['rounds']})")
    add("--warmup", type=int, help=f"untimed rounds first (default {FULL['warmup']})")
    add("--device", choices=("cpu", "cuda"), default=default_device())
    add("--threads", type=int, default=1, help="torch intra-op threads (default 1: steady on a busy machine)")
    add("--quick", action="store_true", help="a smoke run: few steps and rounds, not a measurement")
    add("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("need --steps, --rounds, --threads >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device. HINT: use --device cpu.")
    return args


def plugin_for(kind: str, precision: str, device: str) -> Any:
    """AMPPrecision ("amp") or Fabric's own plugin ("fabric"), with the same scaler settings."""
    if kind == "amp":
        scaler = LossScaler(device, growth_interval=GROWTH_INTERVAL) if precision == "16-mixed" else None
        return AMPPrecision(precision, device=device, scaler=scaler)  # type: ignore[arg-type]
    if precision == "bf16-true":
        return HalfPrecision("bf16-true")
    fp16 = precision == "16-mixed"
    grad_scaler = torch.amp.GradScaler(device, growth_interval=GROWTH_INTERVAL) if fp16 else None
    return MixedPrecision(precision, device, grad_scaler)  # type: ignore[arg-type]


def trainer(
    kind: str, model_name: str, precision: str, clip: bool, args: argparse.Namespace
) -> Callable[[], None]:
    """A function running ``args.steps`` training steps under one plugin."""
    width, layers, batch = MODELS[model_name]
    plugin = plugin_for(kind, precision, args.device)
    fabric = Fabric(accelerator=args.device, devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    x = torch.randn(batch, width, device=fabric.device)

    def run() -> None:
        for _ in range(args.steps):
            fabric.backward(model(x).float().pow(2).mean())
            if clip:
                fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def bench_row(model_name: str, precision: str, clip: bool, args: argparse.Namespace) -> dict[str, Any]:
    cases = [Case(kind, trainer(kind, model_name, precision, clip, args)) for kind in ("amp", "fabric")]
    samples = measure(cases, device=args.device, warmup=args.warmup, repeats=args.rounds)
    # measure() times both cases once per round, so sample i of each comes from the same round.
    ratios = [theirs / ours for ours, theirs in zip(samples["amp"], samples["fabric"], strict=True)]
    to_sps = 1e3 * args.steps
    return {
        "model": model_name, "precision": precision, "clip": clip,
        "amp_steps_per_s": to_sps / median_ms(samples["amp"]),
        "fabric_steps_per_s": to_sps / median_ms(samples["fabric"]),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*emulates.*")  # both plugins run the same autocast
    rows = [
        bench_row(model_name, precision, clip, args)
        for model_name in args.models
        for precision in args.precisions
        for clip in (False, True)
    ]
    headers = ["model", "precision", "clip", "AMPPrecision steps/s", "Fabric's plugin steps/s", "ratio"]
    headers.append("range")
    table = [
        [r["model"], r["precision"], "yes" if r["clip"] else "no", f"{r['amp_steps_per_s']:.1f}",
         f"{r['fabric_steps_per_s']:.1f}", f"{r['ratio']:.3f}x", f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))
    print(f"ratio: median over {args.rounds} paired rounds of AMPPrecision / Fabric's steps/s")
    print("Fabric's plugin: MixedPrecision for '-mixed' rows, HalfPrecision for 'bf16-true'")
    payload = {"benchmark": "fabric_speed", "environment": environment(args.device), "args": vars(args),
               "rows": rows}  # fmt: skip
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
