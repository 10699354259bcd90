"""Going back to Lightning: its ``MixedPrecision`` resumes the loss scale from an ``AMPPrecision`` checkpoint.

The oracle is Lightning's own run: two epochs under ``MixedPrecision`` with a ``GradScaler``
against one epoch under ``AMPPrecision`` (a ``LossScaler`` with GradScaler's policy), a
checkpoint, and the second epoch under ``MixedPrecision`` again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from amp_plugin import AMPPrecision, LossScaler
from tests.integration.test_plugin import TinyModule, _fit_epochs

pytestmark = pytest.mark.filterwarnings("ignore:.*emulates.*")

SETTINGS: dict[str, Any] = {"init_scale": 2.0**16, "growth_interval": 2}


class _ScaleAtStart(Callback):
    """The scale (and growth tracker) Lightning's plugin holds once the checkpoint is restored."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.seen: tuple[float, int] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen = (self.scaler.get_scale(), int(self.scaler._get_growth_tracker()))


def test_lightnings_mixed_precision_resumes_the_scale_of_an_amp_plugin_checkpoint(tmp_path: Path) -> None:
    reference_scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    reference = TinyModule(poison=(1, 2))
    _fit_epochs(reference, MixedPrecision("16-mixed", "cpu", scaler=reference_scaler), epochs=2)

    head = TinyModule(poison=(1, 2))
    ours = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", **SETTINGS))
    trainer = _fit_epochs(head, ours, epochs=1)
    path = str(tmp_path / "amp_plugin.ckpt")
    trainer.save_checkpoint(path)
    assert ours.scaler is not None and ours.scaler.get_scale() != SETTINGS["init_scale"]  # it backed off

    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    probe = _ScaleAtStart(scaler)
    tail = TinyModule(poison=(1, 2))
    _fit_epochs(
        tail, MixedPrecision("16-mixed", "cpu", scaler=scaler), epochs=2, ckpt=path, callbacks=[probe]
    )
    assert probe.seen == (ours.scaler.get_scale(), ours.scaler.state_dict()["_growth_tracker"])
    assert scaler.state_dict() == reference_scaler.state_dict()
    for p, q in zip(reference.parameters(), tail.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_bf16_checkpoint_writes_no_scaler_entry_for_lightning(tmp_path: Path) -> None:
    trainer = _fit_epochs(TinyModule(poison=()), AMPPrecision("bf16-mixed", device="cpu"), epochs=1)
    path = tmp_path / "bf16.ckpt"
    trainer.save_checkpoint(str(path))
    assert "MixedPrecision" not in torch.load(path, weights_only=False)
