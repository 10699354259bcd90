"""fp16 with dynamic loss scaling, on CPU, where you can watch the scaler work.

A tiny MLP learns a regression whose targets are large (|y| up to ~60), trained with
``AMPPrecision("16-mixed", scaler=LossScaler(...))``. Three things happen on the way:

1. warm-up: the first scale (2**16) times the large initial error overflows fp16 in the
   backward pass; each such step is skipped and the scale halves until gradients fit;
2. growth: after every ``growth_interval`` clean steps the scale doubles, probing for the
   largest scale that still fits, and backs off again when it overshoots;
3. a bad batch: at ``--inject-at`` one input is corrupted (x * 1e6, as a broken sample
   would be), the fp16 forward overflows, and that one step is skipped, weights untouched.

A timeline line is printed for every skip and every change of scale, plus a heartbeat
every 50 steps; the summary counts what happened. Lightning's own
``Trainer(precision="16-mixed")`` would run bf16 here instead (Lightning 2.6 turns fp16 into
bf16 on CPU, with a warning); ``AMPPrecision`` honours fp16. Where the CPU has no fp16
instructions it says so once, as information: fp16 is what this example asks for.

Run::

    python examples/fp16_scaler.py
    python examples/fp16_scaler.py --plot runs/fp16_scale.png   # scale and skips over time (matplotlib)
    python examples/fp16_scaler.py --smoke                      # a short run, for tests
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from quickstart import pin_threads, print_key_values, quiet_lightning  # shared with the quickstart
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaleMonitor, LossScaler

FEATURES = 16
TARGET_SIZE = 20.0  # large targets make the first scaled gradients overflow fp16
HEARTBEAT = 50


def make_dataset(n: int, seed: int) -> TensorDataset:
    """Inputs ~ N(0, 1) and a smooth nonlinear target of size ``TARGET_SIZE``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g) / math.sqrt(FEATURES)
    y = TARGET_SIZE * (torch.sin(2 * x @ w) + x[:, :1] * x[:, 1:2] / 2)
    return TensorDataset(x, y)


class Regressor(LightningModule):
    """A 16-64-64-1 MLP trained with MSE; corrupts one input at ``inject_at`` (0: never)."""

    def __init__(self, inject_at: int = 0, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )
        self.inject_at, self.lr = inject_at, lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if self.global_step + 1 == self.inject_at:  # steps count from 1 in the timeline
            x = x.clone()
            x[0] *= 1e6  # a broken sample: fp16 (max 65504) turns its activations into inf
        # The prediction is fp16 under autocast; the loss in fp32 cannot overflow by itself.
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@dataclass
class Event:
    """One line of the timeline."""

    step: int
    loss: float
    scale_before: float
    scale_after: float
    skipped: bool
    total_skipped: int


class Timeline(Callback):
    """Prints a line for every skipped step and scale change, and a heartbeat every few steps."""

    def __init__(self, scaler: LossScaler, heartbeat: int = HEARTBEAT) -> None:
        self.scaler, self.heartbeat = scaler, heartbeat
        self.events: list[Event] = []
        self.clean_losses: list[float] = []
        self._scale_before = scaler.get_scale()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(f"{'step':>5}  {'loss':>10}  {'scale':>9}  {'skipped':>7}  event")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        self._scale_before = self.scaler.get_scale()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step = self.scaler.total_steps  # scaler updates so far, skipped ones included
        loss = float(outputs["loss"])
        if not self.scaler.last_step_skipped:
            self.clean_losses.append(loss)
        event = Event(
            step,
            loss,
            self._scale_before,
            self.scaler.get_scale(),
            self.scaler.last_step_skipped,
            self.scaler.skipped_steps,
        )
        text = _describe(event, self.scaler.get_growth_interval())
        if text or step % self.heartbeat == 0:
            self.events.append(event)
            scale = f"{event.scale_after:9g}"
            print(f"{step:>5}  {loss:>10.4g}  {scale}  {event.total_skipped:>7}  {text}", flush=True)


def _describe(event: Event, growth_interval: int) -> str:
    if event.skipped and not math.isfinite(event.loss):
        what = "loss is inf/NaN (fp16 forward overflowed): step skipped"
    elif event.skipped:
        what = "fp16 gradients overflowed: step skipped"
    elif event.scale_after > event.scale_before:
        return f"{growth_interval} clean steps in a row: scale x{event.scale_after / event.scale_before:g}"
    else:
        return ""
    if event.scale_after < event.scale_before:
        what += f", scale x{event.scale_after / event.scale_before:g}"
    return what


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--max-steps", type=int, default=400, help="training steps, skipped ones included (default: 400)")
    add("--growth-interval", type=int, default=50, help="clean steps per growth (default: 50)")
    add("--inject-at", type=int, default=300, help="corrupt an input at this step (0: never; default: 300)")
    add("--plot", default=None, help="write a PNG of scale and skips here (needs matplotlib)")
    add("--log-dir", default="runs", help="CSV logs go to LOG_DIR/fp16_scaler (default: runs)")
    add("--threads", type=int, default=1, help="intra-op threads (default: 1, steady on a busy machine)")
    add("--smoke", action="store_true", help="a short run, for tests")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print the timeline and the summary, and return the summary's numbers."""
    args = parse_args(argv)
    steps, growth_interval, inject_at = args.max_steps, args.growth_interval, args.inject_at
    if args.smoke:
        steps, growth_interval, inject_at = 60, 10, 45
    quiet_lightning()
    pin_threads(args.threads)  # a tiny model: more threads only wait for each other on a busy machine
    seed_everything(0, verbose=False)
    wall_start = time.perf_counter()

    scaler = LossScaler(
        init_scale=2.0**16,
        growth_interval=growth_interval,
        # A floor and a ceiling: a run that keeps overflowing cannot drive the scale to 0 (torch's
        # GradScaler can), and growth stops where fp16 gradients of this model could never fit.
        min_scale=1.0,
        max_scale=2.0**24,
    )
    timeline = Timeline(scaler)
    monitor = LossScaleMonitor(warmup_steps=20, plot_path=args.plot)
    if inject_at:
        monitor.plot_events.append((inject_at, "corrupted input (injected)"))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[AMPPrecision("16-mixed", scaler=scaler)],
        callbacks=[timeline, monitor],
        logger=CSVLogger(args.log_dir, name="fp16_scaler"),
        log_every_n_steps=10,
        enable_progress_bar=False,  # the timeline is the progress report
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = Regressor(inject_at=inject_at)
    trainer.fit(model, DataLoader(make_dataset(4096, seed=1), batch_size=32, shuffle=True))
    summary = summarize(scaler, timeline, time.perf_counter() - wall_start)
    summary["plot"] = args.plot
    print_summary(summary)
    return summary


def summarize(scaler: LossScaler, timeline: Timeline, wall_seconds: float) -> dict[str, Any]:
    """What the scaler did, counted from the timeline."""
    skips = [e for e in timeline.events if e.skipped]
    growths = [e for e in timeline.events if not e.skipped and e.scale_after > e.scale_before]
    warmup = 0  # the unbroken run of skips from step 1
    while warmup < len(skips) and skips[warmup].step == warmup + 1:
        warmup += 1
    return {
        "final_scale": scaler.get_scale(),
        "skipped_steps": scaler.skipped_steps,
        "total_steps": scaler.total_steps,
        "warmup_skips": warmup,
        "later_skips": [e.step for e in skips[warmup:]],
        "growths": len(growths),
        # One batch's loss is noisy; the mean over the last clean steps says where training ended.
        "final_train_loss": sum(timeline.clean_losses[-20:]) / max(len(timeline.clean_losses[-20:]), 1),
        "wall_seconds": wall_seconds,
    }


def print_summary(summary: dict[str, Any]) -> None:
    later = summary["later_skips"]
    lines = [
        ("precision", "16-mixed (fp16 autocast on CPU, dynamic loss scaling)"),
        ("final scale", f"{summary['final_scale']:g} (started at 65536)"),
        ("skipped steps", f"{summary['skipped_steps']} of {summary['total_steps']}"),
        ("  warm-up", f"{summary['warmup_skips']} (back to back from step 1: finding a scale that fits)"),
        ("  later", f"{len(later)} at steps {later}" if later else "0"),
        ("growths", f"{summary['growths']} (x2 after each clean interval)"),
        ("train loss", f"{summary['final_train_loss']:.3f} (mean of the last 20 clean steps)"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
    ]
    if summary.get("plot"):
        shown = "the scale at logged steps on a 2^k axis, skips marked; below: skips so far"
        lines.append(("plot", f"{summary['plot']} ({shown})"))
    print_key_values("Summary", lines)


if __name__ == "__main__":
    main()
