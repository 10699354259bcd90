"""LossScaler must never let a non-finite value reach the weights, and must refuse bad input cleanly.

Each test here failed on the scaler before the fix it pins (collapse to 0, a NaN written
after unscale_, bad limits and states accepted). The dropped preset grad_scale is pinned
against GradScaler in test_scaler_conformance.py (the preset set before or after unscale_).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from amp_plugin._scale_policy import ScaleFloorWarning
from tests._ops import UNSCALE, AtenOps

FLOOR = 2.0**-126


def _model_and_opt(fused: bool = False) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt: torch.optim.Optimizer
    if fused:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt


def _backward(scaler: Any, model: nn.Module, poison: float | None = None) -> None:
    scaler.scale(model(torch.ones(3, 4)).square().mean()).backward()
    if poison is not None:
        model.weight.grad[0, 0] = poison


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- the scale cannot collapse ---------------------------------------------------------------


def _overflow_then_clean(scaler: Any, steps: int) -> nn.Linear:
    model, opt = _model_and_opt()
    for step in range(steps + 1):
        opt.zero_grad()
        _backward(scaler, model, poison=math.inf if step < steps else None)
        scaler.step(opt)
        scaler.update()
    return model


def test_grad_scaler_collapses_to_zero_and_writes_nan() -> None:
    """The trap we guard against, reproduced with torch's own scaler (the oracle of the next test)."""
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model = _overflow_then_clean(gs, 200)
    assert gs.get_scale() == 0.0
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_default_scaler_stops_at_the_smallest_normal_and_warns_once() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**16)
    with pytest.warns(ScaleFloorWarning, match=r"floor 1.17549e-38 at step \d+.*HINT") as record:
        model = _overflow_then_clean(scaler, 200)
    assert len([w for w in record if issubclass(w.category, ScaleFloorWarning)]) == 1
    assert scaler.get_scale() == FLOOR
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.skipped_steps == 200


def test_floor_warning_names_the_step_it_happened() -> None:
    scaler = LossScaler("cpu", init_scale=4.0, min_scale=1.0)
    model, opt = _model_and_opt()
    for _ in range(5):
        opt.zero_grad()
        _backward(scaler, model, poison=math.nan)
        scaler.step(opt)
        scaler.update()
    with pytest.warns(ScaleFloorWarning, match="floor 1 at step 2 "):
        assert scaler.get_scale() == 1.0


def test_the_floor_is_reported_without_any_host_read_by_the_caller() -> None:
    """Only update() runs (as with a fused optimizer): the report comes within 100 updates."""
    scaler = LossScaler("cpu", init_scale=1.0, min_scale=1.0)
    model, opt = _model_and_opt(fused=True)
    for _ in range(99):
        opt.zero_grad()
        _backward(scaler, model, poison=math.inf)
        scaler.step(opt)
        scaler.update()
    _backward(scaler, model, poison=math.inf)
    scaler.step(opt)
    with pytest.warns(ScaleFloorWarning, match="at step 0 "):
        scaler.update()


def test_a_clean_run_never_warns() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**4, growth_interval=1)
    model, opt = _model_and_opt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScaleFloorWarning)
        for _ in range(120):
            opt.zero_grad()
            _backward(scaler, model)
            scaler.step(opt)
            scaler.update()
        scaler.get_scale()


# -- nothing non-finite reaches the weights after unscale_ ----------------------------------


def test_nan_written_after_unscale_is_caught_by_the_norm_clip() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**8)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.unscale_(opt)
    model.bias.grad[0] = math.nan  # e.g. a hook or a penalty term after unscaling
    before = _params(model)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isnan(norm.item())
    assert scaler.step(opt) is None
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0**7


def test_recheck_catches_a_change_after_unscale() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**8)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.unscale_(opt)
    model.weight.grad[1, 2] = -math.inf
    scaler.recheck_(opt)
    before = _params(model)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.skipped_steps == 1


@pytest.mark.parametrize("kind", ["fp16", "guard"])
def test_the_recheck_launches_what_its_device_reads_fastest(device: str, kind: str) -> None:
    """CPU, gradients the scaler unscaled in place: torch's AMP check (one launch, values as they were).
    CUDA, or a guard that never writes the gradients: their per-tensor norms, read only."""
    fp16 = kind == "fp16"
    scaler = LossScaler(device, init_scale=2.0**8) if fp16 else LossScaler(device, 1.0, dynamic=False)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler.scale(model(torch.ones(3, 4, device=device)).square().mean()).backward()
    scaler.unscale_(opt)
    scaler.recheck_(opt)  # the first check makes the scaler's constant 1.0, once
    with AtenOps() as mode:
        scaler.recheck_(opt)
    if device == "cpu" and fp16:
        assert mode.counts == Counter({UNSCALE: 1})
    else:
        assert mode.counts["_foreach_norm"] == 1 and "_foreach_mul_" not in mode.counts


def test_recheck_of_finite_gradients_changes_nothing() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**8)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    versions = [p.grad._version for p in model.parameters()]
    scaler.recheck_(opt)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    assert [p.grad._version for p in model.parameters()] == versions  # read only: nothing written
    found = scaler.found_inf(opt)
    assert found is not None and found.item() == 0.0
    before = _params(model)
    scaler.step(opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    scaler.update()
    assert scaler.skipped_steps == 0


def test_found_inf_reports_this_iterations_flag() -> None:
    scaler = LossScaler("cpu", init_scale=2.0**8)
    model, opt = _model_and_opt()
    assert scaler.found_inf(opt) is None
    _backward(scaler, model, poison=math.inf)
    scaler.step(opt)
    found = scaler.found_inf(opt)
    assert found is not None and found.item() > 0
    scaler.update()
    assert scaler.found_inf(opt) is None


# -- bad input: a clear error, nothing changed --------------------------------------------------


BAD_CLIPS = [
    ("clip_grad_norm_", {"max_norm": math.nan}, ValueError, r"max_norm=nan"),
    ("clip_grad_norm_", {"max_norm": -1.0}, ValueError, r"max_norm=-1.0.*>= 0"),
    ("clip_grad_norm_", {"max_norm": "1.0"}, TypeError, r"max_norm='1.0'"),
    ("clip_grad_norm_", {"max_norm": math.inf}, ValueError, r"max_norm=inf"),
    ("clip_grad_norm_", {"max_norm": 1.0, "norm_type": 0}, ValueError, r"norm_type=0"),
    ("clip_grad_norm_", {"max_norm": 1.0, "norm_type": -2.0}, ValueError, r"norm_type=-2.0"),
    ("clip_grad_norm_", {"max_norm": 1.0, "norm_type": "two"}, ValueError, r"norm_type='two'"),
    ("clip_grad_norm_", {"max_norm": 1.0, "norm_type": math.nan}, ValueError, r"norm_type=nan"),
    ("clip_grad_norm_", {"max_norm": 1.0, "error_if_nonfinite": "no"}, TypeError, "error_if_nonfinite"),
    ("clip_grad_value_", {"clip_value": math.nan}, ValueError, r"clip_value=nan"),
    ("clip_grad_value_", {"clip_value": -0.5}, ValueError, r"clip_value=-0.5"),
    ("clip_grad_value_", {"clip_value": "0.5"}, TypeError, r"clip_value='0.5'"),
]


@pytest.mark.parametrize(("method", "kwargs", "error", "match"), BAD_CLIPS)
def test_bad_clip_limits_raise_and_change_nothing(
    method: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    scaler = LossScaler("cpu", init_scale=2.0**8)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(error, match=match) as info:
        getattr(scaler, method)(opt, **kwargs)
    assert "HINT" in str(info.value)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    assert scaler.stage(opt) == "ready"
    scaler.step(opt)  # the iteration goes on as if the bad call never happened
    scaler.update()
    assert scaler.skipped_steps == 0


@pytest.mark.parametrize(
    ("new_scale", "error", "match"),
    [
        (math.nan, ValueError, "new_scale=nan"),
        (0.0, ValueError, "new_scale=0.0"),
        (-4.0, ValueError, "new_scale=-4.0"),
        (1e-40, ValueError, "new_scale=1e-40"),
        ("8", TypeError, "new_scale='8'"),
        (torch.ones(2), ValueError, r"shape \(2,\)"),
        (torch.tensor(math.inf), ValueError, "new_scale=inf"),
        (torch.tensor(8, dtype=torch.int64), ValueError, "one-element floating-point"),
        (0.5, ValueError, r"within \[1, 64\]"),
        (128.0, ValueError, r"within \[1, 64\]"),
    ],
)
def test_bad_manual_scale_raises_and_changes_nothing(
    new_scale: Any, error: type[Exception], match: str
) -> None:
    scaler = LossScaler("cpu", init_scale=8.0, min_scale=1.0, max_scale=64.0)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.step(opt)
    with pytest.raises(error, match=match):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 8.0
    assert scaler.stage(opt) == "stepped"  # the iteration is still open: the normal update still works
    scaler.update()
    assert scaler.total_steps == 1


def test_manual_scale_within_bounds_is_taken() -> None:
    scaler = LossScaler("cpu", init_scale=8.0, min_scale=1.0, max_scale=64.0)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0
    scaler.update(new_scale=2)
    assert scaler.get_scale() == 2.0


def test_load_state_dict_is_refused_between_backward_and_step() -> None:
    scaler = LossScaler("cpu", init_scale=8.0)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    sd = {**scaler.state_dict(), "scale": 1024.0}
    with pytest.raises(RuntimeError, match=r"middle of an iteration.*HINT"):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 8.0
    scaler.step(opt)
    scaler.update()
    scaler.load_state_dict(sd)  # between iterations it loads
    assert scaler.get_scale() == 1024.0


def _changed(**change: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda state: {**state, **change}


CORRUPT_STATES = [
    (lambda state: {}, "empty dict comes from a disabled scaler"),
    (lambda state: [1, 2], "is not allowed here: .*the non-empty dict"),
    (lambda state: {"scale": 1.0}, "missing keys"),
    (_changed(weird=1), "unknown keys"),
    (_changed(_growth_tracker=-1), r"_growth_tracker=-1\) is not allowed"),
    (_changed(_growth_tracker=2**31), r"_growth_tracker=2147483648\) is not allowed here: .*an int in \[0, "),
    (_changed(_growth_tracker=1.5), r"_growth_tracker=1.5\) is not allowed here: .*an int"),
    (_changed(_hysteresis_tracker=10**6), r"_hysteresis_tracker=1000000"),
    (_changed(skipped_steps=5, total_steps=4), r"skipped_steps=5"),
    (_changed(scale=math.nan), r"state_dict\['scale'\]=nan"),
    (_changed(scale=0.0), r"state_dict\['scale'\]=0.0"),
    (_changed(scale=1e39), r"state_dict\['scale'\]=1e\+39.*fp32"),  # a finite float fp32 makes inf
    (_changed(scale=1e39, growth_interval=7), r"state_dict\['scale'\]=1e\+39"),  # nothing else loads
    (_changed(growth_factor=0.5), "growth_factor"),
    (_changed(total_steps=-1), "total_steps=-1"),
    (_changed(dynamic="yes"), "dynamic='yes'"),
]


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "between-iterations"])
@pytest.mark.parametrize(("corrupt", "match"), CORRUPT_STATES)
def test_corrupt_states_are_refused_and_change_nothing(
    corrupt: Callable[[dict[str, Any]], Any], match: str, used: bool
) -> None:
    scaler = LossScaler("cpu", init_scale=8.0, hysteresis=2)
    if used:
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=8.0)  # closes the iteration: a state may be loaded now
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match) as info:
        scaler.load_state_dict(corrupt(before))
    assert "HINT" in str(info.value)
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"enabled": "False"}, TypeError, r"enabled='False'.*a bool"),
        ({"dynamic": "False"}, TypeError, r"dynamic='False'.*a bool"),
        ({"enabled": 0}, TypeError, r"enabled=0"),
        ({"process_group": "world"}, TypeError, r"process_group='world'.*ProcessGroup"),
        ({"device": "gpu"}, ValueError, r"device='gpu'.*HINT.*'cuda'"),
        ({"device": ""}, ValueError, r"device=''"),
        ({"device": 0}, TypeError, r"device=0"),
        ({"kernels": "apex"}, RuntimeError, r"kernels='apex'.*amp_C"),
        ({"sync_found_inf": 1}, ValueError, r"sync_found_inf=1"),
        ({"sync_found_inf": "yes"}, ValueError, r"sync_found_inf='yes'"),
        ({"init_scale": 0.0}, ValueError, r"init_scale=0.0.*finite number in"),
        ({"init_scale": float("inf")}, ValueError, "init_scale=inf"),
        ({"init_scale": 1e39}, ValueError, r"init_scale=1e\+39.*fp32"),  # finite in Python, inf in fp32
        ({"init_scale": "1"}, TypeError, r"init_scale='1'.*a number"),
        ({"min_scale": 1e39}, ValueError, r"min_scale=1e\+39"),
        ({"max_scale": 1e39}, ValueError, r"max_scale=1e\+39"),
        ({"growth_factor": 1.0}, ValueError, r"growth_factor=1.0.*> 1"),
        ({"backoff_factor": 1.0}, ValueError, r"backoff_factor=1.0.*\(0, 1\)"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor=0.0"),
        ({"growth_interval": 0}, ValueError, "growth_interval=0"),
        ({"growth_interval": 2.5}, ValueError, "growth_interval=2.5"),
        ({"hysteresis": 0}, ValueError, r"hysteresis=0.*int >= 1"),
        ({"min_scale": -1.0}, ValueError, "min_scale=-1.0"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, "min_scale <= max_scale"),
        ({"init_scale": 1.0, "min_scale": 2.0}, ValueError, r"init_scale=1.0.*within"),
        ({"kernels": "cuda"}, ValueError, r"kernels='cuda'.*allowed"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        LossScaler(**kwargs)
    assert "HINT" in str(info.value)


@pytest.mark.parametrize(
    ("setter", "value", "error"),
    [
        ("set_growth_factor", 1.0, ValueError),
        ("set_growth_factor", math.nan, ValueError),
        ("set_backoff_factor", 1.5, ValueError),
        ("set_backoff_factor", "0.5", TypeError),
        ("set_growth_interval", 0, ValueError),
        ("set_growth_interval", 2.5, TypeError),
    ],
)
def test_bad_setter_values_raise_and_change_nothing(setter: str, value: Any, error: type[Exception]) -> None:
    scaler = LossScaler("cpu")
    before = scaler.state_dict()
    with pytest.raises(error, match="HINT"):
        getattr(scaler, setter)(value)
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    "new_scale", [1e39, torch.tensor(1e39, dtype=torch.float64)], ids=["float", "fp64-tensor"]
)
def test_a_manual_scale_fp32_cannot_hold_is_refused(new_scale: Any) -> None:
    scaler = LossScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"new_scale=1e\+39.*HINT"):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("scaler_type", [LossScaler, torch.amp.GradScaler])
def test_a_state_saved_after_set_growth_interval_lowered_the_interval_loads(scaler_type: type) -> None:
    scaler = scaler_type("cpu")
    model, opt = _model_and_opt()
    for _ in range(5):
        _backward(scaler, model)
        scaler.step(opt)
        scaler.update()
    scaler.set_growth_interval(3)  # below the 5 clean steps counted: the tracker counts on, as torch's
    _backward(scaler, model)
    scaler.step(opt)
    scaler.update()
    state = scaler.state_dict()
    assert state["_growth_tracker"] > state["growth_interval"]
    for target in (LossScaler("cpu"), LossScaler.from_grad_scaler(torch.amp.GradScaler("cpu"))):
        target.load_state_dict(state)
        assert target.state_dict()["_growth_tracker"] == state["_growth_tracker"]


@pytest.mark.parametrize(("poison", "skipped"), [(None, 0), (math.inf, 1)])
def test_an_iteration_closed_by_a_manual_scale_is_counted(poison: float | None, skipped: int) -> None:
    scaler = LossScaler("cpu", init_scale=8.0)
    model, opt = _model_and_opt()
    _backward(scaler, model, poison)
    scaler.step(opt)
    scaler.update(new_scale=4.0)
    assert (scaler.total_steps, scaler.skipped_steps) == (1, skipped)
    assert scaler.last_step_skipped is bool(skipped)
    assert scaler.get_scale() == 4.0
    scaler.scale(torch.ones(()))  # no step in this iteration: nothing to count
    scaler.update(new_scale=2.0)
    assert (scaler.total_steps, scaler.skipped_steps) == (1, skipped)



def test_from_grad_scaler_refuses_settings_the_grad_scaler_gives() -> None:
    with pytest.raises(TypeError, match=r"from_grad_scaler\(init_scale=4.0\).*come from the GradScaler"):
        LossScaler.from_grad_scaler(torch.amp.GradScaler("cpu"), init_scale=4.0)
    assert LossScaler.from_grad_scaler(torch.amp.GradScaler("cpu"), hysteresis=2).hysteresis == 2
