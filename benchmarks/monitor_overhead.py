"""What ``LossScaleMonitor`` costs: steps/s with and without it, and with ``trace_nonfinite=True``.

The quickstart run (``examples/quickstart.py``: its transformer, data, AdamW + one-cycle
schedule, ``gradient_clip_val=1.0``, ``log_every_n_steps=10``, a CSV logger; no validation and
no progress bar, which would only add noise) trains three ways: no monitor, the monitor
(tracing off), the monitor with ``trace_nonfinite=True``. One sample is one ``Trainer.fit`` of
``--steps`` steps; its rate is taken from the end of step ``--skip`` to the end of the last step
(set-up and the first steps excluded). Samples interleave: the order rotates, and runs backwards
every other round. A configuration's rate is one over the median of all its step times (pooled
over its samples): on a shared machine a burst of load slows some steps, and the median of steps
shrugs that off better than the median of whole fits. The monitor's own hook time is also measured
directly (a timed subclass): that is the overhead without the machine's noise.

    python benchmarks/monitor_overhead.py                  # table
    python benchmarks/monitor_overhead.py --json out.json  # table + JSON
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
from _common import default_device, environment, format_table, round_order, write_json
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision, LossScaleMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import Config, MajorityTransformer, make_dataset, quiet_lightning

CONFIGS = ("no monitor", "monitor", "monitor + trace")
TARGET = 1.02  # the monitor (tracing off) may cost at most 2%


class StepClock(Callback):
    """Time stamps at the end of every training batch (the last callback, so it sees the monitor's work)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.stamps.append(time.perf_counter())


class TimedMonitor(LossScaleMonitor):
    """``LossScaleMonitor`` whose per-step hooks time themselves."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_s = 0.0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)
        self.hook_s += time.perf_counter() - start

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.hook_s += time.perf_counter() - start


def _fit(config: str, args: argparse.Namespace, data: DataLoader) -> tuple[list[float], float]:
    """One sample: (the step times after the skipped steps in s, the monitor's hook time per step in us)."""
    clock = StepClock()
    monitor = None if config == "no monitor" else TimedMonitor(trace_nonfinite=config.endswith("trace"))
    trainer = Trainer(
        accelerator=args.device, devices=1, max_steps=args.steps, gradient_clip_val=1.0,
        plugins=[AMPPrecision(args.precision)], callbacks=[c for c in (monitor, clock) if c],
        logger=CSVLogger(args.logdir, name="monitor_overhead"), log_every_n_steps=args.log_every_n_steps,
        limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MajorityTransformer(_config(args), total_steps=args.steps), data)
    timed = clock.stamps[args.skip - 1 :]
    hook_us = 0.0 if monitor is None else 1e6 * monitor.hook_s / args.steps
    return [b - a for a, b in itertools.pairwise(timed)], hook_us


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--precision", choices=("auto", "bf16-mixed", "16-mixed"), default="auto")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device())
    parser.add_argument("--steps", type=int, default=40, help="training steps per sample")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of each sample's rate")
    parser.add_argument("--repeats", type=int, default=3, help="samples per configuration")
    parser.add_argument("--log-every-n-steps", type=int, default=10, help="as in the quickstart")
    parser.add_argument("--d-model", type=int, default=256, help="the quickstart's transformer, this wide")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--logdir", type=Path, default=Path("/tmp/amp_plugin_monitor_overhead"))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 12 steps, 1 sample, small model")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.skip, args.repeats, args.d_model, args.batch = 12, 2, 1, 64, 16
    if not 1 <= args.skip < args.steps:
        parser.error(f"--skip={args.skip} must be in [1, --steps) so that some steps are timed")
    return args


def _config(args: argparse.Namespace) -> Config:
    return Config(d_model=args.d_model, batch_size=args.batch)


def main() -> None:
    args = parse_args()
    quiet_lightning()
    warnings.filterwarnings(
        "ignore", message=".*validation_step.* but have no `val_dataloader`"
    )  # on purpose
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the monitor's summary, once per fit
    data = DataLoader(make_dataset(args.batch * args.steps, seed=1), batch_size=args.batch, shuffle=True)
    _fit("monitor", args, data)  # warm-up: imports, allocator, thread pools
    step_s: dict[str, list[float]] = {c: [] for c in CONFIGS}
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}  # per sample, for the spread
    hooks: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for round_index in range(args.repeats):
        for config in round_order(CONFIGS, round_index):
            times, hook_us = _fit(config, args, data)
            step_s[config] += times
            rates[config].append(1 / statistics.median(times))
            hooks[config].append(hook_us)
    median = {c: 1 / statistics.median(t) for c, t in step_s.items()}
    hook = {c: statistics.median(h) for c, h in hooks.items()}
    base = median["no monitor"]
    rows = [
        [
            c, f"{median[c]:.2f}", f"{1e3 / median[c]:.2f}", f"{base / median[c]:.3f}",
            f"{hook[c]:.0f}" if c != "no monitor" else "-",
            f"{100 * hook[c] * 1e-6 * median[c]:.2f}%" if c != "no monitor" else "-",
            f"{100 * statistics.pstdev(rates[c]) / statistics.mean(rates[c]):.1f}%",
        ]
        for c in CONFIGS
    ]  # fmt: skip
    params = sum(p.numel() for p in MajorityTransformer(_config(args)).parameters())
    print(
        f"LossScaleMonitor overhead on the quickstart run: {args.precision} on {args.device}, transformer "
        f"{params / 1e6:.2f}M params, batch {args.batch}, log_every_n_steps={args.log_every_n_steps}; median "
        f"step of {args.repeats} interleaved fits of {args.steps} steps (first {args.skip} untimed), "
        f"{torch.get_num_threads()} threads; spread = stdev/mean of the per-fit rates"
    )
    print(
        format_table(
            ["configuration", "steps/s", "ms/step", "slowdown", "hook us/step", "hook share", "spread"], rows
        )
    )
    slowdown = base / median["monitor"]
    verdict = "meets" if slowdown <= TARGET else "misses"
    share = 100 * hook["monitor"] * 1e-6 * median["monitor"]
    print(
        f"\nmonitor (tracing off): {100 * (slowdown - 1):+.2f}% end to end, {verdict} the <= 2% target; "
        f"its hooks alone take {hook['monitor']:.0f} us/step ({share:.2f}% of a step)."
        f"\ntrace_nonfinite=True: {base / median['monitor + trace']:.2f}x the time per step."
    )
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "monitor_overhead",
                "environment": environment(args.device),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "params": params,
                "steps_per_s": median,
                "slowdown_vs_no_monitor": {c: base / median[c] for c in CONFIGS},
                "hook_us_per_step": hook,
                "samples_steps_per_s": rates,
                "target_slowdown": TARGET,
            },
        )


if __name__ == "__main__":
    main()
