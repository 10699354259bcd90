"""fp32 gradient accumulation for half weights: what it costs per step, and its training curves.

The quickstart's transformer (``examples/quickstart.py``: its data, AdamW + one-cycle schedule,
``gradient_clip_val=1.0``) trains with ``Trainer(accumulate_grad_batches=--accumulate)`` under
half weights, with ``AMPPrecision(fp32_grad_accumulation=True)`` (the default: micro-batch
gradients add up in fp32) and ``False`` (they add up in the half ``.grad``, as in Lightning's
``"bf16-true"``):

  bf16-true      the weights in bf16, no fp32 copy (rounding to nearest)
  O2 bf16        ``"bf16-mixed"`` with ``master_weights=True``: bf16 weights, fp32 masters

plus an fp32 run (``"32-true"``, the same accumulation) as the reference curve.

Cost: fits of ``--steps`` optimizer steps, interleaved (the order rotates, and runs backwards
every other round), each timed from the end of optimizer step ``--skip`` to its last; a set-up's
time per optimizer step is the median over its timed steps, pooled over ``--repeats`` fits; the
ratio is on / off of the same weights. Target: fp32 accumulation costs at most 2% of a step.

Curves: the loss of every optimizer step (the mean over its micro-batches) of the first round's
fits (the runs are seeded: later rounds repeat them), printed at a few steps and as the mean of
the last quarter; ``--plot PATH`` draws them (matplotlib).

    python benchmarks/grad_accumulation.py                   # table
    python benchmarks/grad_accumulation.py --json out.json   # table + JSON
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import environment, format_table, round_order, write_json
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import Config, MajorityTransformer, make_dataset, quiet_lightning

WEIGHTS: dict[str, dict[str, Any]] = {
    "bf16-true": {"precision": "bf16-true"},
    "O2 bf16": {"precision": "bf16-mixed", "master_weights": True},
}
TARGET = 1.02  # fp32 accumulation may cost at most 2% of an optimizer step


class StepLog(Callback):
    """The time at the end of each optimizer step, and its loss (the mean over its micro-batches).

    Lightning hands ``on_train_batch_end`` each micro-batch's loss divided by the number of
    micro-batches (what backward saw), so the step's mean loss is their sum.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.losses: list[float] = []
        self._micro: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        self._micro.append(outputs["loss"].detach())
        if len(self._micro) == trainer.accumulate_grad_batches:  # this micro-batch closed a step
            self.losses.append(float(torch.stack(self._micro).sum()))
            self._micro = []
            self.stamps.append(time.perf_counter())


def _fit(setup: str, args: argparse.Namespace, data: DataLoader, config: Config) -> StepLog:
    weights, _, mode = setup.partition(" / ")
    plugin = (
        AMPPrecision("32-true", device="cpu")
        if setup == "fp32"
        else AMPPrecision(device="cpu", fp32_grad_accumulation=mode == "fp32 sums", **WEIGHTS[weights])
    )
    log = StepLog()
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0, plugins=[plugin], callbacks=[log], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(MajorityTransformer(config, total_steps=args.steps), data)
    return log


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per fit")
    parser.add_argument("--accumulate", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--skip", type=int, default=4, help="first optimizer steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=3, help="fits per set-up (interleaved rounds)")
    parser.add_argument("--d-model", type=int, default=64, help="the quickstart's transformer, this wide")
    parser.add_argument("--batch", type=int, default=32, help="sequences per micro-batch")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--plot", type=Path, default=None, help="draw the loss curves into this PNG")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps of 2 micro-batches")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.accumulate, args.skip, args.repeats, args.d_model, args.batch = 4, 2, 1, 1, 32, 8
    if not 1 <= args.skip < args.steps:
        parser.error(f"--skip={args.skip} must be in [1, --steps) so that some steps are timed")
    if args.accumulate < 2:
        parser.error(f"--accumulate={args.accumulate}: fp32 accumulation acts from 2 micro-batches per step")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*emulates.*")  # a CPU without bf16 instructions: said once
    warnings.filterwarnings("ignore", message=".*validation_step.* but have no `val_dataloader`")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    config = Config(d_model=args.d_model, batch_size=args.batch)
    data = DataLoader(make_dataset(args.batch * args.accumulate * args.steps, seed=1), batch_size=args.batch)
    setups = [f"{w} / {m}" for w in WEIGHTS for m in ("fp32 sums", "half .grad")] + ["fp32"]
    step_s: dict[str, list[float]] = {s: [] for s in setups}
    curves: dict[str, list[float]] = {}
    _fit(setups[0], args, data, config)  # warm-up: imports, allocator, thread pools
    for round_index in range(args.repeats):
        for setup in round_order(setups, round_index):
            log = _fit(setup, args, data, config)
            stamps = log.stamps[args.skip - 1 :]
            step_s[setup] += [b - a for a, b in itertools.pairwise(stamps)]
            curves.setdefault(setup, log.losses)
    ms = {s: 1e3 * statistics.median(t) for s, t in step_s.items()}
    ratio = {w: ms[f"{w} / fp32 sums"] / ms[f"{w} / half .grad"] for w in WEIGHTS}
    tail = max(1, args.steps // 4)
    final = {s: statistics.mean(c[-tail:]) for s, c in curves.items()}
    marks = sorted({0, args.steps // 4, args.steps // 2, args.steps - 1})
    params = sum(p.numel() for p in MajorityTransformer(config).parameters())
    print(
        f"fp32 gradient accumulation on the quickstart transformer ({params / 1e6:.2f}M params), "
        f"{args.accumulate} micro-batches of {args.batch} per optimizer step, {args.steps} steps per fit, "
        f"{args.repeats} interleaved fits per set-up, {torch.get_num_threads()} thread(s); ms/step: median "
        f"optimizer step after the first {args.skip}"
    )
    rows = [
        [
            s, f"{ms[s]:.1f}",
            f"{ratio[s.partition(' / ')[0]]:.3f}x" if s.endswith("fp32 sums") else "-",
            *(f"{curves[s][m]:.5f}" for m in marks), f"{final[s]:.5f}",
        ]
        for s in setups
    ]  # fmt: skip
    losses = [f"loss @{m + 1}" for m in marks]
    headers = ["set-up", "ms/step", "fp32 sums / half", *losses, f"loss, last {tail}"]
    print(format_table(headers, rows))
    for w in WEIGHTS:
        verdict = "meets" if ratio[w] <= TARGET else "misses"
        print(f"{w}: fp32 sums cost {100 * (ratio[w] - 1):+.1f}% of a step, {verdict} the <= 2% target")
    if args.plot is not None:
        _plot(curves, args.plot)
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "grad_accumulation",
                "environment": environment("cpu"),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "params": params,
                "ms_per_step": ms,
                "cost_ratio": ratio,
                "target_ratio": TARGET,
                "final_loss": final,
                "curves": curves,
            },
        )


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for setup, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=setup, linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="training loss (mean of the micro-batches)", yscale="log")
    ax.set_title("fp32 gradient accumulation: training curves")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
