"""``AMPPrecision(spike_guard=SpikeGuard())`` in ``Trainer.fit`` on the quickstart's model.

With the defaults a whole quickstart run skips nothing; a batch whose loss is multiplied by 1e3
is skipped, counted, and leaves the weights, the optimizer state and the loss scale as they were.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.spike import SpikeGuard

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
SPIKE_AT = 40


def _quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart_for_spikes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Snapshots(Callback):
    """The weights and optimizer state before the spiked batch and before the one after it."""

    def __init__(self) -> None:
        self.taken: dict[int, tuple[list[torch.Tensor], Any, float]] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if batch_idx in (SPIKE_AT, SPIKE_AT + 1) and batch_idx not in self.taken:
            guard = trainer.precision_plugin.guard  # type: ignore[attr-defined]
            self.taken[batch_idx] = (
                [p.detach().clone() for p in pl_module.parameters()],
                copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
                guard.get_scale() if step else 0.0,
            )


def _fit(precision: str, steps: int, spike_at: int | None) -> tuple[AMPPrecision, SpikeGuard, _Snapshots]:
    quickstart = _quickstart()
    seed_everything(0, verbose=False)
    base = quickstart.MajorityTransformer

    class Spiked(base):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(batch, batch_idx)
            return loss * 1e3 if batch_idx == spike_at else loss

    config = quickstart.Config()
    model = Spiked(config, total_steps=steps)
    data = DataLoader(quickstart.make_dataset(config.train_samples, seed=1), batch_size=32, shuffle=True)
    spike = SpikeGuard()
    # fp16: a scale low enough that the spiked batch's gradients stay finite (an overflow would back
    # the scale off, rightly); the spike alone must leave it.
    scaler = LossScaler(init_scale=8.0) if precision == "16-mixed" else None
    plugin = AMPPrecision(precision, scaler=scaler, spike_guard=spike)
    snapshots = _Snapshots()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        gradient_clip_val=1.0,
        plugins=[plugin],
        callbacks=[snapshots],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    return plugin, spike, snapshots


def test_a_whole_quickstart_run_skips_nothing_with_the_default_guard() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the quickstart's own setting; restored below
    try:
        plugin, spike, _ = _fit("bf16-mixed", 300, spike_at=None)
    finally:
        torch.set_num_threads(threads)
    guard = plugin.guard
    assert guard is not None and guard.total_steps == 300
    assert guard.skipped_steps == 0 and spike.spikes() == 0 and spike.recorded() == 300


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_spiked_batch_is_skipped_in_fit_and_changes_nothing(precision: str) -> None:
    plugin, spike, snapshots = _fit(precision, SPIKE_AT + 5, spike_at=SPIKE_AT)
    guard = plugin.guard
    assert guard is not None
    assert guard.skipped_steps == 1 and spike.spikes() == 1
    (w0, s0, scale0), (w1, s1, scale1) = snapshots.taken[SPIKE_AT], snapshots.taken[SPIKE_AT + 1]
    assert all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True))
    for key in s0:
        for name, value in s0[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(s1[key][name])), (key, name)
    assert scale0 == scale1  # a spike is not an overflow: the fp16 scale does not back off
