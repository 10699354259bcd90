"""Where a bf16 training step's time goes: Lightning's MixedPrecision against AMPPrecision, profiled.

A profile, not a benchmark (``benchmarks/report.py`` does not run it): it answers why one set-up is
slower than another on a GPU. The quickstart's transformer, widened (12 layers of d_model 768, 512
tokens, batch 16; ``--quick``: 2 x 64, 32 tokens, batch 8), trains with fused AdamW and a
step-interval OneCycle schedule in ``Trainer.fit`` under four set-ups: ``mp`` (``MixedPrecision``
bf16), ``amp`` (``AMPPrecision`` bf16: guarded, ``lr_on_skip="hold"``), ``amp-advance``
(``lr_on_skip="advance"``) and ``amp-noguard`` (``guard=False``). Per set-up, in an order that
rotates and runs backwards every other round:

* free ms: the mean step over the timed batches with one device sync at each end (the host may
  run ahead of the GPU, as in real training);
* synced ms: the median step with a sync around each batch (host and device time added up);
* from ``torch.profiler`` over a few more steps: kernels and GPU-busy ms per step, device syncs
  and copies per step, and the aten calls per step that differ from ``mp``.

A step whose free ms is well above its GPU-busy ms is host-bound: its speed is Python's.

    python benchmarks/gpu/profile_bf16_step.py --device cuda --json profile.json
    python benchmarks/gpu/profile_bf16_step.py --quick     # CPU smoke run (no kernels to count)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
import torch
from _common import environment, format_table, load_example, round_order, synchronize
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader
from training_speed import _transformer, quiet_lightning

from amp_plugin import AMPPrecision

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


class StepTimer(Callback):
    """Times batches ``warm`` to ``warm + timed``; optionally profiles the ``profiled`` batches after them."""

    def __init__(self, device: str, warm: int, timed: int, profiled: int, synced: bool) -> None:
        self.device, self.warm, self.timed, self.profiled, self.synced = device, warm, timed, profiled, synced
        self.free_s, self.batch_s, self._t0, self._start = 0.0, [], 0.0, 0.0
        self.prof: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, i: int) -> None:
        if i == self.warm:
            synchronize(self.device)
            self._t0 = time.perf_counter()
        if self.synced and self.warm <= i < self.warm + self.timed:
            synchronize(self.device)
            self._start = time.perf_counter()
        if self.profiled and i == self.warm + self.timed:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        if self.synced and self.warm <= i < self.warm + self.timed:
            synchronize(self.device)
            self.batch_s.append(time.perf_counter() - self._start)
        if i == self.warm + self.timed - 1:
            synchronize(self.device)
            self.free_s = (time.perf_counter() - self._t0) / self.timed
        if self.prof is not None and i == self.warm + self.timed + self.profiled - 1:
            synchronize(self.device)
            self.prof.__exit__(None, None, None)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="timed fits per set-up and mode (default 3)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    quiet_lightning()
    warnings.filterwarnings("ignore")
    dev = args.device
    quickstart = load_example("quickstart")
    if args.quick:
        config, rounds, (warm, timed, profiled) = quickstart.Config(batch_size=8), 1, (2, 3, 2)
    else:
        quickstart.SEQ_LEN = 512  # the module's constant: its model and data read it when built
        config = quickstart.Config(d_model=768, layers=12, heads=12, batch_size=16)
        rounds, (warm, timed, profiled) = args.rounds, (8, 20, 3)
    total = warm + timed + profiled + 1
    data = quickstart.make_dataset(config.batch_size * total, seed=1)
    setups = {
        "mp": lambda: MixedPrecision("bf16-mixed", dev),
        "amp": lambda: AMPPrecision("bf16-mixed", device=dev),
        "amp-advance": lambda: AMPPrecision("bf16-mixed", device=dev, lr_on_skip="advance"),
        "amp-noguard": lambda: AMPPrecision("bf16-mixed", device=dev, guard=False),
    }

    def fit(name: str, synced: bool, profile: bool) -> StepTimer:
        torch.manual_seed(0)
        timer = StepTimer(dev, warm, timed, profiled if profile else 0, synced)
        Trainer(
            accelerator=dev,
            devices=1,
            max_steps=total,
            plugins=[setups[name]()],
            callbacks=[timer],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        ).fit(_transformer(quickstart, True)(config, total_steps=total), DataLoader(data, config.batch_size))
        return timer

    names = list(setups)
    free: dict[str, list[float]] = collections.defaultdict(list)
    synced: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(rounds):
        for name in round_order(names, r):
            free[name].append(fit(name, synced=False, profile=False).free_s * 1e3)
            synced[name].append(statistics.median(fit(name, synced=True, profile=False).batch_s) * 1e3)
    results: dict[str, dict[str, Any]] = {}
    calls: dict[str, collections.Counter[str]] = {}
    for name in names:
        prof = fit(name, synced=False, profile=True).prof
        assert prof is not None
        events = prof.key_averages()
        on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        calls[name] = collections.Counter(
            {e.key: e.count for e in events if e.key.startswith(("aten::", "cuda")) and e not in on_gpu}
        )
        results[name] = {
            "free_ms": statistics.median(free[name]),
            "synced_ms": statistics.median(synced[name]),
            "kernels_per_step": sum(e.count for e in on_gpu) / profiled,
            "gpu_busy_ms_per_step": sum(e.self_device_time_total for e in on_gpu) / profiled / 1e3,
            "syncs_and_copies_per_step": {k: calls[name][k] / profiled for k in SYNCS if calls[name][k]},
        }
    for name in names[1:]:
        keys = set(calls[name]) | set(calls["mp"])
        diff = {
            k: (calls[name][k] - calls["mp"][k]) / profiled for k in keys if calls[name][k] != calls["mp"][k]
        }
        results[name]["calls_vs_mp_per_step"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))
    print(__doc__.split("\n\n")[0])
    print(
        format_table(
            ["set-up", "free ms", "synced ms", "vs mp (free)", "kernels/step", "GPU busy ms/step"],
            [
                [
                    n,
                    f"{r['free_ms']:.2f}",
                    f"{r['synced_ms']:.2f}",
                    f"{results['mp']['free_ms'] / r['free_ms']:.3f}x",
                    f"{r['kernels_per_step']:.0f}",
                    f"{r['gpu_busy_ms_per_step']:.2f}",
                ]
                for n, r in results.items()
            ],
        )
    )
    for name in names[1:]:
        print(f"{name}: aten/CUDA calls per step against mp: {results[name]['calls_vs_mp_per_step']}")
    out = {
        "benchmark": "profile_bf16_step",
        "environment": environment(dev),
        "rounds": rounds,
        "results": results,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
