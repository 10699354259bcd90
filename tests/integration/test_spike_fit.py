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
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

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


def _fit(
    precision: str, steps: int, spike_at: int | None, spike_kind: str = "loss"
) -> tuple[AMPPrecision, SpikeGuard, _Snapshots]:
    quickstart = _quickstart()
    seed_everything(0, verbose=False)
    base = quickstart.MajorityTransformer

    class Spiked(base):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(batch, batch_idx)
            if batch_idx != spike_at:
                return loss
            if spike_kind == "loss":
                return loss * 1e3
            return loss + 999.0 * (loss - loss.detach())  # the loss's value, 1e3x its gradients

    config = quickstart.Config()
    model = Spiked(config, total_steps=steps)
    data = DataLoader(quickstart.make_dataset(config.train_samples, seed=1), batch_size=32, shuffle=True)
    spike = SpikeGuard(on=("loss", "grad_norm"))
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
    assert guard.skipped_steps == 0 and spike.spikes() == 0
    assert spike.recorded("loss") == spike.recorded("grad_norm") == 300


@pytest.mark.parametrize(
    ("precision", "spike_kind"), [("bf16-mixed", "loss"), ("16-mixed", "loss"), ("bf16-mixed", "grad_norm")]
)
def test_a_spiked_batch_is_skipped_in_fit_and_changes_nothing(precision: str, spike_kind: str) -> None:
    # The fit clips by norm (gradient_clip_val=1.0): the gradient-norm spike is judged on the norm before
    # the clip, the one the clip computed.
    plugin, spike, snapshots = _fit(precision, SPIKE_AT + 5, spike_at=SPIKE_AT, spike_kind=spike_kind)
    guard = plugin.guard
    assert guard is not None
    assert guard.skipped_steps == 1 and spike.spikes() == 1
    (w0, s0, scale0), (w1, s1, scale1) = snapshots.taken[SPIKE_AT], snapshots.taken[SPIKE_AT + 1]
    assert all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True))
    for key in s0:
        for name, value in s0[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(s1[key][name])), (key, name)
    assert scale0 == scale1  # a spike is not an overflow: the fp16 scale does not back off


# -- resuming from a checkpoint -------------------------------------------------------------------

EPOCH = 8  # batches per epoch of the resume test


class _Small(LightningModule):
    """A small regression model whose loss (or gradients) spikes at the given global batch indices."""

    def __init__(self, loss_spikes: tuple[int, ...], grad_spikes: tuple[int, ...]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.loss_spikes, self.grad_spikes = loss_spikes, grad_spikes
        self.skipped: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        index = self.current_epoch * EPOCH + batch_idx
        if index in self.loss_spikes:
            return loss * 1e3
        if index in self.grad_spikes:
            return loss + 999.0 * (loss - loss.detach())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        guard = self.trainer.precision_plugin.guard  # type: ignore[attr-defined]
        self.skipped.append(guard.last_step_skipped)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _resume_fit(
    precision: str, on: tuple[Any, ...], epochs: int, ckpt: Path | None, save: Path | None
) -> tuple[_Small, AMPPrecision]:
    seed_everything(0, verbose=False)
    model = _Small(loss_spikes=(3 * EPOCH + 2,), grad_spikes=(3 * EPOCH + 5,))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(EPOCH * 16, 8, generator=gen), torch.randn(EPOCH * 16, 1, generator=gen)
    data = DataLoader(TensorDataset(x, y), batch_size=16)  # no shuffle: a resumed epoch sees the same batches
    # A warm-up longer than the steps after the resume: a restarted history would let the spikes through.
    plugin = AMPPrecision(
        precision,
        scaler=LossScaler(init_scale=8.0) if precision == "16-mixed" else None,
        spike_guard=SpikeGuard(warmup=16, window=20, on=on),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        gradient_clip_val=1.0,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return model, plugin


@pytest.mark.parametrize(
    ("precision", "on"), [("bf16-mixed", ("loss",)), ("16-mixed", ("loss", "grad_norm"))]
)
def test_a_resumed_fit_makes_the_same_skip_decisions_bit_for_bit(
    tmp_path: Path, precision: str, on: tuple[Any, ...]
) -> None:
    straight, straight_plugin = _resume_fit(precision, on, 5, None, None)
    ckpt = tmp_path / "three_epochs.ckpt"
    first, _ = _resume_fit(precision, on, 3, None, ckpt)
    resumed, resumed_plugin = _resume_fit(precision, on, 5, ckpt, None)

    expected = [3 * EPOCH + 2, 3 * EPOCH + 5] if "grad_norm" in on else [3 * EPOCH + 2]
    assert [i for i, s in enumerate(straight.skipped) if s] == expected
    assert first.skipped + resumed.skipped == straight.skipped
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    states = [p.guard.state_dict() for p in (straight_plugin, resumed_plugin)]  # type: ignore[union-attr]
    assert states[0]["spike_guard"] == states[1]["spike_guard"]  # the history, bit for bit
    assert states[0]["skipped_steps"] == states[1]["skipped_steps"] == len(expected)
