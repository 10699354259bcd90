"""``StepDriver``: one guarded optimizer step's order, in plain torch (no Lightning)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from amp_plugin import LossScaler
from amp_plugin._step import StepDriver


def _model_and_opt(fused: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if fused:
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(driver: StepDriver, model: torch.nn.Module, value: float = 1.0) -> None:
    driver.backward(model(torch.full((3, 4), value)).sum(), torch.Tensor.backward)


def test_the_hooks_see_unscaled_gradients_and_a_nan_they_write_skips_the_step() -> None:
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=2.0**8))
    _backward(driver, model)
    seen: list[float] = []

    def hooks() -> bool:
        grad = model.bias.grad
        assert grad is not None
        seen.append(float(grad[0]))  # unscaled: 3 rows of ones
        grad[0] = float("nan")
        return False

    before = [p.detach().clone() for p in model.parameters()]
    assert driver.step(opt, hooks) is None
    assert seen == [3.0]
    assert driver.last_step_skipped and driver.step_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_fast_path_leaves_the_hooks_the_scaled_gradients() -> None:
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=2.0**8))
    _backward(driver, model)
    seen: list[float] = []
    driver.step(opt, lambda: bool(seen.append(float(model.bias.grad[0])) or False), observe_unscaled=False)
    assert seen == [3.0 * 2**8] and not driver.last_step_skipped


@pytest.mark.parametrize(("fused", "known"), [(False, bool), (True, torch.Tensor)])
def test_a_non_fused_skip_is_known_on_the_host_and_a_fused_one_stays_on_the_device(
    fused: bool, known: type
) -> None:
    model, opt = _model_and_opt(fused)
    driver = StepDriver(LossScaler("cpu", init_scale=1.0, dynamic=False))
    _backward(driver, model, float("inf"))
    driver.step(opt, lambda: False)
    assert isinstance(driver.last_skip, known)
    assert driver.known_skip(opt) == (None if fused else True)
    assert driver.last_step_skipped  # reads the device flag where it has to


def test_manual_optimization_updates_the_scale_once_per_batch() -> None:
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=2.0**8, growth_interval=1))
    for _ in range(2):  # a critic stepped twice in one batch, each after its own backward
        _backward(driver, model)
        driver.step(opt, lambda: False, update=False)
    assert driver.scaler is not None and driver.scaler.total_steps == 0
    driver.end_batch()
    assert driver.scaler.total_steps == 1 and driver.scaler.get_scale() == 2.0**9


def test_stepping_twice_without_a_backward_raises_with_a_hint() -> None:
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu"))
    _backward(driver, model)
    driver.step(opt, lambda: False, update=False)
    with pytest.raises(RuntimeError, match=r"stepped twice.*HINT: call manual_backward"):
        driver.step(opt, lambda: False, update=False)


def test_a_batch_without_gradients_is_not_stepped_and_counts_as_skipped() -> None:
    _, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu"))
    ran: list[Any] = []
    driver.not_stepped(opt, lambda: ran.append(True))
    assert ran == [True] and driver.step_skipped(opt) and driver.known_skip(opt) is True


def test_without_a_scaler_the_driver_steps_unguarded() -> None:
    model, opt = _model_and_opt()
    moved: list[Any] = []
    driver = StepDriver(None, before_step=moved.append)
    model(torch.full((3, 4), float("inf"))).sum().backward()
    driver.step(opt, lambda: False)
    assert moved == [opt]  # master gradients would move here
    assert not torch.isfinite(model.weight).all() and not driver.last_step_skipped


def test_a_batch_without_gradients_does_not_mark_the_next_batch_as_skipped() -> None:
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=2.0**8))
    driver.not_stepped(opt, lambda: None)
    assert driver.last_step_skipped
    _backward(driver, model)
    driver.step(opt, lambda: False)
    assert not driver.last_step_skipped and driver.last_skip is False


def test_the_driver_keeps_the_norm_a_clip_computed_or_a_request_asked_for() -> None:
    """One owner of a step's gradient norm: the plugins read ``last_grad_norm`` from the driver."""
    model, opt = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=2.0**8))
    unscaled = [torch.full((2, 4), 3.0), torch.full((2,), 3.0)]  # 3 rows of ones
    exact = torch.cat([g.flatten() for g in unscaled]).double().norm().item()

    driver.begin_batch()
    opt.zero_grad()
    _backward(driver, model)
    driver.step(opt, lambda: None)
    assert driver.last_grad_norm is None  # neither clipped nor asked for: no read

    driver.begin_batch()
    opt.zero_grad()
    _backward(driver, model)
    driver.request_grad_norm()
    driver.step(opt, lambda: None)
    assert driver.last_grad_norm is not None and driver.last_grad_norm.item() == pytest.approx(exact)

    driver.begin_batch()
    assert driver.last_grad_norm is None
    opt.zero_grad()
    _backward(driver, model)
    driver.step(opt, lambda: driver.clip_grad_norm_(opt, 1.0))
    assert driver.last_grad_norm is not None and driver.last_grad_norm.item() == pytest.approx(exact)

    driver.begin_batch()
    opt.zero_grad()
    _backward(driver, model)
    driver.request_grad_norm()
    driver.not_stepped(opt, lambda: None)  # training_step returned None: no step, no norm
    assert driver.last_grad_norm is None


@pytest.mark.parametrize("scaler", [LossScaler("cpu", init_scale=2.0**8), None], ids=["fp16", "unguarded"])
@pytest.mark.parametrize(
    ("args", "kwargs", "seedable", "seeded"),
    [
        ((), {}, True, True),
        ((), {"retain_graph": True}, True, True),
        ((), {}, False, False),  # an overridden LightningModule.backward may drop gradient=
        ((torch.tensor(2.0),), {}, True, False),  # a gradient passed positionally
        ((), {"gradient": torch.tensor(2.0)}, True, False),
    ],
    ids=["plain", "retain_graph", "not-seedable", "positional-gradient", "gradient"],
)
def test_backward_seeds_a_plain_call_and_scales_the_loss_for_any_other(
    scaler: LossScaler | None, args: tuple[Any, ...], kwargs: dict[str, Any], seedable: bool, seeded: bool
) -> None:
    """Whatever the route, the gradients are the scaled loss's: the caller's gradient times the scale."""
    model, _ = _model_and_opt()
    driver = StepDriver(scaler)
    calls: list[tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]] = []

    def run(loss: torch.Tensor, *a: Any, **k: Any) -> None:
        calls.append((loss, a, k))
        loss.backward(*a, **k)

    loss = model(torch.ones(3, 4)).sum()
    driver.backward(loss, run, *args, seedable=seedable, **kwargs)
    (given, a, k), = calls
    factor = 2.0**8 if scaler is not None else 1.0
    if scaler is None:
        assert given is loss and (a, k) == (args, kwargs)
    elif seeded:
        assert given is loss and a == () and torch.equal(k.pop("gradient"), torch.tensor(factor))
        assert k == kwargs
    else:
        assert given is not loss and torch.equal(given, loss * factor) and (a, k) == (args, kwargs)
    upstream = 2.0 if args or "gradient" in kwargs else 1.0
    assert torch.equal(model.bias.grad, torch.full((2,), 3.0 * upstream * factor))


def test_backward_scales_a_loss_of_many_elements() -> None:
    model, _ = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=4.0))
    driver.backward(model(torch.ones(3, 4)), torch.Tensor.backward, gradient=torch.ones(3, 2))
    assert torch.equal(model.bias.grad, torch.full((2,), 12.0))


@pytest.mark.parametrize("seedable", [True, False], ids=["seeded", "scaled"])
def test_backward_under_no_grad_works_on_every_route_as_in_torch(seedable: bool) -> None:
    """``loss.backward()`` under ``torch.no_grad()`` works in torch; so it does here, seeded or scaled."""
    model, _ = _model_and_opt()
    driver = StepDriver(LossScaler("cpu", init_scale=4.0))
    loss = model(torch.ones(3, 4)).sum()
    with torch.no_grad():
        driver.backward(loss, torch.Tensor.backward, seedable=seedable)
    assert torch.equal(model.bias.grad, torch.full((2,), 12.0))
