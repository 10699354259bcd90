"""A step-interval LR scheduler holds on the skipped step itself, fused optimizers included.

The oracle is the same fit with a non-fused AdamW, whose skip is decided on the host: the LR at
the start of every step must be the same with ``AdamW(fused=True)``, in every precision. And a fit
resumed from a checkpoint written after a skipped step ends bit-exactly where the uninterrupted
fit ends: weights, optimizer state, scheduler and skip count.

On a GPU a fused step's flag is not read at the scheduler's step (that would wait for the whole
step): the scheduler advances, and the next optimizer step takes the advance back if the flag,
copied to the host meanwhile, says skipped. On a CPU the flag is known at once; the tests marked
"deferred" make it wait as on a GPU, and hold the LR each optimizer step uses to the oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaleMonitor, LossScaler
from amp_plugin._step import StepDriver

BATCHES = 5  # per epoch
POISONED = (3, 7)  # global batch indices whose gradients hold an inf


class _Model(LightningModule):
    def __init__(self, fused: bool, poisoned: tuple[int, ...] = POISONED) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.fused, self.poisoned = fused, poisoned
        self.lrs: list[float] = []  # the LR at the start of each step
        self.stepped_lrs: list[float] = []  # the LR each optimizer step was given

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.total_batch_idx in self.poisoned:
            self.net[2].weight.grad[0, 3] = float("inf")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        opt.register_step_pre_hook(lambda o, args, kwargs: self.stepped_lrs.append(o.param_groups[0]["lr"]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused step's flag is answered later, as on a GPU (the value is the same; its timing is not)."""
    known_now = StepDriver.deferred_skip

    def later(self: StepDriver, optimizer: Any) -> Any:
        value = known_now(self, optimizer)
        return value if callable(value) else (lambda: value)

    monkeypatch.setattr(StepDriver, "deferred_skip", later)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 4, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(precision: str, epochs: int, **kwargs: Any) -> Trainer:
    # fp16 starts at a scale that does not overflow, so that only the poisoned steps are skipped.
    scaler = LossScaler(init_scale=2.0**4) if precision == "16-mixed" else None
    plugin = AMPPrecision(precision, device="cpu", scaler=scaler)  # type: ignore[arg-type]
    return Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, plugins=[plugin], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **{"logger": False, **kwargs},
    )  # fmt: skip


PRECISIONS = ["bf16-mixed", "16-mixed", "32-true"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_a_fused_optimizers_scheduler_holds_on_the_skipped_step_itself(precision: str) -> None:
    lrs = {}
    for fused in (False, True):
        model = _Model(fused)
        trainer = _trainer(precision, epochs=2)
        trainer.fit(model, _loader())
        lrs[fused] = model.lrs
        assert trainer.precision_plugin.guard.skipped_steps == len(POISONED)  # type: ignore[attr-defined]
    held = [i for i in range(1, len(lrs[False])) if lrs[False][i] == lrs[False][i - 1]]
    assert held == [p + 1 for p in POISONED]  # the oracle holds right after each skipped step
    assert lrs[True] == lrs[False]


def _state(model: _Model, trainer: Trainer, monitor: LossScaleMonitor) -> dict[str, Any]:
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "adam": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
        "last_epoch": sched.last_epoch,  # type: ignore[union-attr]
        "lr": opt.param_groups[0]["lr"],
        "skipped": trainer.precision_plugin.guard.skipped_steps,  # type: ignore[attr-defined]
        "health": monitor.state_dict()["health"],  # the monitor's step and skip counts
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_a_resume_across_a_skip_with_fused_adamw_is_bit_exact(precision: str, tmp_path: Path) -> None:
    _resume_matches_the_whole_fit(precision, tmp_path, POISONED)  # written after batch 4; 3 was skipped


def _resume_matches_the_whole_fit(precision: str, tmp_path: Path, poisoned: tuple[int, ...]) -> Any:
    """A 3-epoch fit against 1 epoch, a checkpoint, and 2 more resumed from it; returns the checkpoint dict.

    The resumed fit ends bit-exactly where the whole one does: weights, AdamW state, scheduler,
    LR, skip count and the monitor's health counts.
    """
    whole, monitor = _Model(fused=True, poisoned=poisoned), LossScaleMonitor()
    trainer = _trainer(precision, epochs=3, callbacks=[monitor])
    trainer.fit(whole, _loader())
    expected = _state(whole, trainer, monitor)

    first = _Model(fused=True, poisoned=poisoned)
    trainer = _trainer(precision, epochs=1, callbacks=[LossScaleMonitor()])
    trainer.fit(first, _loader())
    ckpt = tmp_path / "after_skip.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, monitor = _Model(fused=True, poisoned=poisoned), LossScaleMonitor()
    trainer = _trainer(precision, epochs=3, callbacks=[monitor])
    trainer.fit(resumed, _loader(), ckpt_path=ckpt)
    got = _state(resumed, trainer, monitor)

    for key in ("last_epoch", "lr", "skipped", "health"):
        assert got[key] == expected[key], key
    assert all(torch.equal(a, b) for a, b in zip(got["weights"], expected["weights"], strict=True))
    for a, b in zip(got["adam"], expected["adam"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    return torch.load(ckpt, weights_only=False)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_deferred_each_fused_step_gets_the_held_lr(precision: str, deferred: None) -> None:
    stepped = {}
    for fused in (False, True):
        model = _Model(fused)
        trainer = _trainer(precision, epochs=2)
        trainer.fit(model, _loader())
        stepped[fused] = model.stepped_lrs
        sched = trainer.lr_scheduler_configs[0].scheduler
        assert sched.last_epoch == 2 * BATCHES - len(POISONED)  # type: ignore[union-attr]
    # A non-fused skipped step never calls optimizer.step(); a fused one does, with the held LR.
    taken = [lr for i, lr in enumerate(stepped[True]) if i not in POISONED]
    assert len(stepped[True]) == 2 * BATCHES and taken == stepped[False]
    assert all(stepped[True][p] == stepped[True][p + 1] for p in POISONED)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_deferred_a_checkpoint_written_right_after_a_skipped_step_resumes_bit_exactly(
    precision: str, tmp_path: Path, deferred: None
) -> None:
    poisoned = (2, 4)  # batch 4 ends epoch 1: the checkpoint is written with its skip not yet read
    saved = _resume_matches_the_whole_fit(precision, tmp_path, poisoned)
    assert saved["lr_schedulers"][0]["last_epoch"] == BATCHES - len(poisoned)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.8**3)


@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_deferred_a_skipped_last_step_is_held_once_the_fit_ends(deferred: None) -> None:
    model = _Model(fused=True, poisoned=(BATCHES - 1,))
    trainer = _trainer("bf16-mixed", epochs=1)
    trainer.fit(model, _loader())
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.8 ** (BATCHES - 1))  # held, not advanced
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == BATCHES - 1  # type: ignore[union-attr]


@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_deferred_lightnings_lr_monitor_logs_the_held_lr(tmp_path: Path, deferred: None) -> None:
    """LearningRateMonitor reads the scheduler's optimizer as a batch starts: that settles the advance."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    logged = {}
    for fused in (False, True):
        logger = CSVLogger(tmp_path, name=f"fused{fused}")
        monitor = LearningRateMonitor(logging_interval="step")
        _trainer("bf16-mixed", epochs=2, callbacks=[monitor], logger=logger, log_every_n_steps=1).fit(
            _Model(fused), _loader()
        )
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            logged[fused] = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    assert len(logged[True]) == 2 * BATCHES and logged[True] == logged[False]
