"""Host reads per training step, against Lightning's ``MixedPrecision`` on the same run.

A host read (``.item()``, ``bool(tensor)``, ``.tolist()``) is ``aten._local_scalar_dense``; on a
GPU each one waits for the device. On steps that do not log the guard adds at most one, shared
by the scaler, the scheduler hold and the monitor: a non-fused optimizer must be skipped on the
host; a fused one skips inside its kernel, and its flag is read only to hold a step-interval
scheduler on the skipped step itself (none with ``lr_on_skip="advance"``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaleMonitor, LossScaler
from amp_plugin.diagnostics._host_reads import HostReads

STEPS, LOG_EVERY = 12, 4


class _PerStep(Callback):
    """Reads per batch, from the batch's start to the end of every other callback's batch end."""

    def __init__(self, mode: HostReads) -> None:
        self.mode, self.start, self.per_step = mode, 0, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.start = self.mode.count

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_step.append(self.mode.count - self.start)


class _Model(LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.fused = fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        if self.fused:
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        else:  # torch's single-tensor Adam reads its step counter on the host by itself; SGD reads nothing
            opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _reads(plugin: Any, fused: bool, monitor: bool) -> list[int]:
    mode = HostReads()
    counter = _PerStep(mode)
    callbacks: list[Callback] = [LossScaleMonitor(), counter] if monitor else [counter]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 4, 8, generator=g)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin], callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=LOG_EVERY,
    )  # fmt: skip
    with mode:
        trainer.fit(_Model(fused), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    return counter.per_step


def _lightning(precision: str) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if precision == "16-mixed" else None
    return MixedPrecision(precision, device="cpu", scaler=scaler)  # type: ignore[arg-type]


def _ours(precision: str, lr_on_skip: str) -> AMPPrecision:
    scaler = LossScaler(init_scale=2.0**8) if precision == "16-mixed" else None
    return AMPPrecision(precision, device="cpu", scaler=scaler, lr_on_skip=lr_on_skip)  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize(
    ("fused", "lr_on_skip", "extra"),
    [(True, "hold", 1), (True, "advance", 0), (False, "hold", 1)],
    ids=["fused-hold", "fused-advance", "non-fused"],
)
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_no_extra_host_read_on_steps_that_do_not_log(
    precision: str, fused: bool, lr_on_skip: str, extra: int
) -> None:
    theirs = _reads(_lightning(precision), fused, monitor=False)
    ours = _reads(_ours(precision, lr_on_skip), fused, monitor=True)
    logged = {i for i in range(STEPS) if (i + 1) % LOG_EVERY == 0} | {STEPS - 1}
    quiet = [i for i in range(STEPS) if i not in logged and i > 0]  # step 0 creates the scale
    assert all(ours[i] - theirs[i] <= extra for i in quiet), (ours, theirs)
