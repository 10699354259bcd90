"""AMPPrecision's checks without a Trainer.fit: the wrapped module, its device, who observes gradients."""

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


def test_the_module_device_comes_from_device_then_parameters() -> None:
    assert checks.module_device(BoringModel()) == "cpu"
    assert checks.module_device(nn.Linear(2, 1).to("meta")) == "meta"
    assert checks.module_device(nn.ReLU()) == "cpu"


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


def test_fit_start_refuses_lbfgs_only_under_loss_scaling() -> None:
    model = nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    checks.check_fit_start(model, [lbfgs], "cpu", torch.bfloat16, grad_scaling=False)
    with pytest.raises(ValueError, match=r"cannot drive LBFGS.*HINT: use precision='bf16-mixed'"):
        checks.check_fit_start(model, [lbfgs], "cpu", torch.float16, grad_scaling=True)


def _half_model(frozen_at_cast: bool = False) -> nn.Module:
    from amp_plugin.master_weights import cast_model

    model = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    model[0].weight.requires_grad_(not frozen_at_cast)
    cast_model(model, torch.float16)
    model[0].weight.requires_grad_(True)
    return model


def test_fit_start_with_masters_accepts_an_eps_fp16_would_round_to_zero() -> None:
    model = _half_model()  # the optimizer steps the fp32 masters
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    checks.check_fit_start(model, [opt], "cpu", torch.float16, grad_scaling=True, weights="master")


@pytest.mark.parametrize("case", ["frozen at the cast", "never cast"])
def test_fit_start_with_masters_refuses_a_half_parameter_stepped_without_one(case: str) -> None:
    model = _half_model(frozen_at_cast=True) if case == "frozen at the cast" else nn.Linear(2, 1).half()
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    with pytest.raises(
        ValueError, match=r"optimizer 0 \(AdamW\) steps \d float16 param.*weight.*no fp32 master.*HINT: set"
    ):
        checks.check_fit_start(model, [opt], "cpu", torch.float16, grad_scaling=True, weights="master")


def test_fit_start_with_half_weights_refuses_an_eps_fp16_rounds_to_zero() -> None:
    model = nn.Linear(2, 1).half()
    opts = [torch.optim.AdamW(model.parameters())]
    with pytest.raises(ValueError, match=r"AdamW\(eps=1e-08\).*HINT"):
        checks.check_fit_start(model, opts, "cpu", torch.float16, True, "half")


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


@pytest.mark.parametrize("weights", ["master", "half"])
def test_lbfgs_with_half_weights_is_refused_at_fit_start(weights: str) -> None:
    """LBFGS evaluates its closure several times per step: master weights and "-true" rounding
    cannot follow that, so it is refused before anything changes (it failed with a raw error)."""
    model = torch.nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"LBFGS.*HINT: .*'bf16-mixed'"):
        checks.check_fit_start(model, [lbfgs], "cpu", torch.bfloat16, False, weights)
