"""AMPPrecision without a Trainer.fit: a MixedPrecision to Lightning; GradScaler input; bad input; connect."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin._schedulers import SkipAwareScheduler

# -- a MixedPrecision to Lightning ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
def test_lightning_treats_it_as_mixed_precision(precision: str, dtype: torch.dtype) -> None:
    plugin = AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    assert isinstance(plugin, MixedPrecision)
    # What ThroughputMonitor.setup computes its FLOPs for (it reported float32 for both before).
    assert throughput_monitor._plugin_to_compute_dtype(plugin) == dtype


def test_every_mixed_precision_method_is_our_own() -> None:
    """Methods inherited from MixedPrecision would drive a torch GradScaler; a new one must fail here."""
    inherited = {name for name, value in vars(MixedPrecision).items() if inspect.isfunction(value)}
    inherited |= {n for n, v in vars(MixedPrecision).items() if isinstance(v, (staticmethod, classmethod))}
    # A method is ours when a class before MixedPrecision in the MRO (AMPPrecision or a mixin) defines it.
    mro = AMPPrecision.__mro__
    mine = set().union(*(vars(cls) for cls in mro[: mro.index(MixedPrecision)]))
    assert inherited <= mine, sorted(inherited - mine)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_every_attribute_mixed_precision_init_sets_is_set_without_calling_it(precision: str) -> None:
    """AMPPrecision inherits MixedPrecision (ThroughputMonitor, Lightning's checkpoint connector and
    user isinstance checks treat it as one) but does not run its __init__, which accepts only the
    two "-mixed" strings, needs the device up front and builds a torch GradScaler. What that
    __init__ sets, ours sets too, with the same meaning (a new attribute there fails here)."""
    theirs = MixedPrecision(precision, "cpu")  # type: ignore[arg-type]
    ours = AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    mro = AMPPrecision.__mro__
    properties = {  # the settings and the scaler are properties: they read the run (one for both plugins)
        name
        for cls in mro[: mro.index(MixedPrecision)]
        for name, value in vars(cls).items()
        if isinstance(value, property)
    }
    mine = set(vars(ours)) | properties
    assert set(vars(theirs)) <= mine, sorted(set(vars(theirs)) - mine)
    assert (ours.precision, ours.device) == (theirs.precision, theirs.device)
    assert (ours.scaler is None) == (theirs.scaler is None)


def test_fsdp_strategy_refuses_the_plugin_loudly() -> None:
    """Lightning's FSDP strategy accepts only its FSDPPrecision: the failure is loud, never silent."""
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=AMPPrecision("16-mixed", device="cpu"))


@pytest.mark.cuda
def test_fsdp_trainer_refuses_the_plugin_on_cuda() -> None:
    with pytest.raises((TypeError, ValueError), match="FSDPPrecision"):
        Trainer(accelerator="cuda", devices=1, strategy="fsdp", plugins=[AMPPrecision("16-mixed")])


# -- a torch.amp.GradScaler is accepted -------------------------------------------------------------


def _stepped_grad_scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
    )
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(5):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if i == 1:
            model.weight.grad.fill_(math.inf)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def test_a_grad_scaler_is_converted_with_its_settings_and_state() -> None:
    grad_scaler = _stepped_grad_scaler()
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=grad_scaler)  # type: ignore[arg-type]
    scaler = plugin.scaler
    assert isinstance(scaler, LossScaler)
    assert scaler.get_scale() == grad_scaler.get_scale() == 1024.0 * 0.25 * 4.0
    settings = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert settings == (4.0, 0.25, 3)
    assert scaler.state_dict()["_growth_tracker"] == grad_scaler.state_dict()["_growth_tracker"] == 0
    grad_scaler2 = _stepped_grad_scaler()
    model = nn.Linear(2, 1)  # one more clean step: the tracker carries on from the GradScaler's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in (scaler, grad_scaler2):
        s.scale(model(torch.ones(1, 2)).sum()).backward()
        s.step(opt)
        s.update()
    assert scaler.state_dict()["_growth_tracker"] == grad_scaler2.state_dict()["_growth_tracker"] == 1


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clip_fused": 1}, ValueError, r"clip_fused=1\) is not allowed here: "
            r".*one of 'auto', True, False\. HINT"),
        ({"clip_fused": "True"}, ValueError, r"clip_fused='True'\) is not allowed.*HINT"),
        (
            {"lr_on_skip": None},
            ValueError,
            r"lr_on_skip=None\) is not allowed here: .*one of 'hold', 'advance'\. HINT",
        ),
        (
            {"scaler": "LossScaler"},
            TypeError,
            r"scaler='LossScaler'\) is not allowed here: "
                r".*an amp_plugin\.LossScaler or a torch\.amp\.GradScaler\. "
            "HINT",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AMPPrecision("16-mixed", device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"precision": "16"},
            ValueError,
            r"^AMPPrecision\(precision='16'\) is not allowed here: .*.*HINT: use '16-mixed'",
        ),
        ({"precision": "fp32"}, ValueError, r"Allowed: one of '16-mixed', 'bf16-mixed', 'auto'"),
        ({"precision": "bf16-mixed", "scaler": LossScaler()}, ValueError, "does not use a loss scaler"),
        ({"precision": "auto", "scaler": LossScaler()}, ValueError, "ambiguous"),
        (
            {"precision": "16-mixed", "scaler": "GradScaler"},
            TypeError,
            "Allowed: an amp_plugin.LossScaler",
        ),
        ({"precision": "16-mixed", "kernels": "fast"}, ValueError, "kernels='fast'"),
        ({"precision": "16-mixed", "clip_fused": "yes"}, ValueError, "clip_fused='yes'"),
        ({"precision": "16-mixed", "lr_on_skip": "skip"}, ValueError, "lr_on_skip='skip'"),
        ({"precision": "16-mixed", "fp32_modules": [int]}, TypeError, "HINT"),
        (
            {"precision": "16-mixed", "fp32_functions": ["sigmoid"]},
            TypeError,
            r"^AMPPrecision\(fp32_functions=\['sigmoid'\]\) is not allowed here: .*.*'sigmoid' is a name",
        ),
        ({"precision": "16-mixed", "fp32_functions": (nn.Sigmoid,)}, TypeError, r"Sigmoid is a class"),
        (
            {"precision": "16-mixed", "device": "meta"},
            ValueError,
            r"not available for device type 'meta'.*HINT",
        ),
        ({"precision": "16-mixed", "device": "gpu"}, ValueError, r"device='gpu'.*HINT.*'cuda'"),
        ({"precision": "16-mixed", "device": ""}, ValueError, r"device=''.*HINT"),
        ({"precision": "16-mixed", "device": 0}, TypeError, r"device=0.*HINT"),
        ({"precision": "16-mixed", "clip_fused": 1}, ValueError, r"clip_fused=1"),
        ({"precision": "16-mixed", "clip_fused": "True"}, ValueError, r"clip_fused='True'"),
    ],
)
def test_bad_arguments_raise_clearly(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AMPPrecision(**kwargs)


def test_a_bare_fp32_module_class_gets_our_message_naming_the_argument() -> None:
    match = r"^AMPPrecision\(fp32_modules=<class .*LayerNorm'>\) is not allowed here: .*a tuple .*HINT: wrap"
    with pytest.raises(TypeError, match=match):
        AMPPrecision("bf16-mixed", fp32_modules=nn.LayerNorm)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^AMPPrecision\(keep_fp32=<class .*LayerNorm'>\) is not allowed"):
        AMPPrecision("bf16-true", keep_fp32=nn.LayerNorm)  # type: ignore[arg-type]


def test_fp32_functions_are_validated_once_and_entered_only_inside_forward_context() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", fp32_functions=torch.sigmoid)
    assert plugin.fp32_functions == (torch.sigmoid,)
    x = torch.randn(2, dtype=torch.float16)
    assert torch.sigmoid(x).dtype == torch.float16  # nothing global
    with plugin.forward_context():
        assert torch.sigmoid(x).dtype == torch.float32
        assert torch.tanh(x).dtype == torch.float16
    assert torch.sigmoid(x).dtype == torch.float16


def test_no_fp32_functions_enter_no_mode() -> None:
    seen: list[bool] = []
    with AMPPrecision("bf16-mixed", device="cpu").forward_context():
        seen.append(torch._C._is_torch_function_mode_enabled())
    with AMPPrecision("32-true", device="cpu", fp32_functions=torch.sigmoid).forward_context():  # type: ignore[arg-type]
        seen.append(torch._C._is_torch_function_mode_enabled())
    assert seen == [False, False]


# -- connect, called by the strategy at fit start ---------------------------------------------------


def test_connect_resolves_the_device_and_wraps_step_schedulers_once() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    class Config:  # the fields of Lightning's LRSchedulerConfig that connect reads
        def __init__(self, interval: str) -> None:
            self.scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
            self.interval = interval

    step, epoch = Config("step"), Config("epoch")
    plugin = AMPPrecision("16-mixed")
    plugin.connect(model, [opt], [step, epoch])
    assert (plugin.device, plugin.dtype) == ("cpu", torch.float16)
    assert isinstance(step.scheduler, SkipAwareScheduler)
    assert not isinstance(epoch.scheduler, SkipAwareScheduler)
    wrapped = step.scheduler
    plugin.connect(model, [opt], [step])  # a second fit
    assert step.scheduler is wrapped


def test_fit_start_warnings_point_at_the_plugin() -> None:
    model = nn.Sequential(nn.DataParallel(nn.Linear(2, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AMPPrecision("bf16-mixed", device="cpu").connect(model, [opt], [])
    [warning] = [w for w in caught if "AutocastDataParallel" in str(w.message)]
    assert warning.filename.endswith(("amp_plugin/lightning/_plugin.py", "amp_plugin\\lightning\\plugin.py"))


def test_the_autocast_context_resolves_a_plugin_without_device() -> None:
    plugin = AMPPrecision("bf16-mixed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with plugin.autocast_context_manager():
        assert torch.is_autocast_enabled(device)
    assert (plugin.device, plugin.dtype) == (device, torch.bfloat16)


# -- "-true": the default dtype, as in Lightning's HalfPrecision ------------------------------------


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_precisions_build_and_run_in_the_half_dtype(precision: str, dtype: torch.dtype) -> None:
    plugin = AMPPrecision(precision)  # type: ignore[arg-type]  # no device yet: "-true" fixes the dtype
    before = torch.get_default_dtype()
    with plugin.module_init_context():
        assert nn.Linear(2, 2).weight.dtype == dtype
    with plugin.tensor_init_context():
        assert torch.empty(1).dtype == dtype
    assert torch.get_default_dtype() == before
    with plugin.forward_context():
        assert torch.ones(1).dtype == dtype
    assert torch.get_default_dtype() == before


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_other_precisions_keep_the_default_dtype(precision: str) -> None:
    plugin = AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    with plugin.module_init_context():
        assert nn.Linear(2, 2).weight.dtype == torch.float32
    with plugin.forward_context():
        assert torch.ones(1).dtype == torch.float32


def test_the_default_dtype_is_restored_after_an_error_in_forward() -> None:
    plugin = AMPPrecision("bf16-true")
    with pytest.raises(KeyError), plugin.forward_context():
        raise KeyError
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_convert_module_casts_a_plain_module_as_halfprecision(precision: str, dtype: torch.dtype) -> None:
    """Called directly (no Trainer, no Fabric), as HalfPrecision.convert_module is in Lightning's tests."""
    module = nn.Linear(2, 2)
    converted = AMPPrecision(precision).convert_module(module)  # type: ignore[arg-type]
    assert converted.weight.dtype == converted.bias.dtype == dtype


@pytest.mark.parametrize(("precision", "seen"), [("bf16-true", torch.float16), ("32-true", torch.float16)])
def test_throughput_monitor_reads_fp16_for_true_precisions_as_the_docs_say(
    precision: str, seen: torch.dtype
) -> None:
    """docs/scaler.md states this limit of Lightning's ThroughputMonitor; a Lightning fix fails here."""
    plugin = AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    assert throughput_monitor._plugin_to_compute_dtype(plugin) == seen


def test_repr_reads_as_the_call_in_lightnings_choose_one_error() -> None:
    # Lightning's "Received both `precision=...` and `plugins=...`" showed <...AMPPrecision object at 0x...>.
    assert repr(AMPPrecision("16-mixed")) == "amp_plugin.AMPPrecision('16-mixed')"
    with pytest.raises(ValueError, match=r"plugins=amp_plugin\.AMPPrecision\('auto'\)`\. Choose one"):
        Trainer(accelerator="cpu", precision="16-mixed", plugins=[AMPPrecision()])
