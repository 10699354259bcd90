"""The Trainer plugin's readers (the wrapped module, who observes gradients) and the CPU note."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from amp_plugin import AMPPrecision
from amp_plugin.lightning import _checks as checks
from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision
from amp_plugin.precision import cpu_emulation_note


def _trainer(*callbacks: Callback) -> Trainer:
    return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=list(callbacks))


def test_the_lightning_module_is_found_inside_wrappers() -> None:
    module = BoringModel()
    outer = nn.Module()
    outer.module = nn.Module()
    outer.module.module = module
    assert checks.lightning_module(outer) is module
    assert checks.lightning_module(module) is module
    plain = nn.Linear(2, 1)
    assert checks.lightning_module(plain) is plain


class _Hooked(BoringModel):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:  # fmt: skip
        pass


class _Watching(BoringModel):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


class _Observer(Callback):
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        pass


class _Bystander(Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("module", "callbacks", "observed"),
    [
        (BoringModel(), (), False),
        (BoringModel(), (_Bystander(),), False),
        (_Hooked(), (), True),
        (_Watching(), (), True),
        (BoringModel(), (_Observer(),), True),
    ],
)
def test_who_can_observe_gradients(
    module: LightningModule, callbacks: tuple[Callback, ...], observed: bool
) -> None:
    assert checks.hooks_observe_gradients(module, _trainer(*callbacks)) is observed


def _emulating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amp_plugin.precision.native_on_cpu", lambda dtype: dtype == torch.float32)


def test_the_emulation_note_names_the_instructions_each_dtype_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    _emulating(monkeypatch)
    fp16, bf16 = cpu_emulation_note(torch.float16), cpu_emulation_note(torch.bfloat16)
    assert fp16 is not None and "no fp16 instructions (AVX512-FP16 or AMX-FP16)" in fp16
    assert bf16 is not None and "no bf16 instructions (AVX512-BF16 or AMX)" in bf16
    monkeypatch.setattr("amp_plugin.precision.native_on_cpu", lambda dtype: True)
    assert cpu_emulation_note(torch.float16) is None


def test_an_emulated_precision_is_said_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The quickstart builds three plugins (its run and the fp32 comparison): one message, not three."""
    _emulating(monkeypatch)
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for plugin in (AMPPrecision, AMPPrecision, FabricAMPPrecision):
            plugin("16-mixed", device="cpu")
    assert caplog.text.count("emulates fp16") == 1
    assert not [w for w in caught if "emulates" in str(w.message)]


def test_an_emulated_precision_asked_for_by_name_is_information_and_auto_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _emulating(monkeypatch)
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AMPPrecision("bf16-mixed", device="cpu")
    assert "AMPPrecision('bf16-mixed'): this CPU has no bf16 instructions" in caplog.text
    assert not [w for w in caught if "emulates" in str(w.message)]
    said = r"AMPPrecision\('bf16-mixed'\): this CPU has no bf16 .*\nHINT: train in fp32"  # two lines
    with pytest.warns(UserWarning, match=said):
        AMPPrecision("auto", device="cpu")
