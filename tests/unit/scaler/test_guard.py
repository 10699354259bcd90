"""``LossScaler`` as a guard (a static scale of 1) and the checks every scaler shares.

A guard scales nothing, reads the gradients without writing them, and skips a step whose loss
or gradients are inf/NaN; every scaler reports a long run of skips once, by itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from amp_plugin import LossScaler
from amp_plugin._scale_policy import SkipStreakWarning
from amp_plugin.diagnostics._host_reads import HostReads


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _guard(**kwargs: Any) -> LossScaler:
    return LossScaler("cpu", init_scale=1.0, dynamic=False, **kwargs)


SCALERS = [_guard, lambda: LossScaler("cpu", init_scale=256.0)]


def test_a_guard_passes_the_loss_through_and_never_writes_the_gradients() -> None:
    model, opt = _model()
    guard = _guard()
    loss = model(torch.ones(3, 4)).sum().to(torch.bfloat16)
    scaled = guard.scale(loss)
    assert scaled.dtype == torch.bfloat16 and torch.equal(scaled, loss)
    scaled.backward()
    versions = [p.grad._version for p in model.parameters()]
    guard.unscale_(opt)
    guard.recheck_(opt)
    assert [p.grad._version for p in model.parameters()] == versions  # read, never written
    assert guard.step(opt) is None or True
    guard.update()
    assert not guard.last_step_skipped and guard.get_scale() == 1.0


@pytest.mark.parametrize("scaler", SCALERS, ids=["guard", "fp16"])
def test_a_nan_loss_with_finite_gradients_is_skipped(scaler: Any) -> None:
    """log(-1) added to a loss leaves its gradients finite: only the loss says something went wrong."""
    model, opt = _model()
    s = scaler()
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(3, 4)).sum() + torch.log(torch.tensor(-1.0))
    s.scale(loss).backward()
    assert s.step(opt) is None
    s.update()
    assert s.last_step_skipped and s.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_finite_loss_is_scaled_exactly_as_grad_scaler_scales_it() -> None:
    loss = torch.tensor(3.14159, dtype=torch.float16)
    ours = LossScaler("cpu", init_scale=2.0**10).scale(loss)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10).scale(loss.float())
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_a_fused_optimizer_skips_inside_its_kernel_under_a_guard() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = _guard()
    guard.scale(model(torch.ones(3, 4)).sum()).backward()
    guard.step(opt)
    guard.update()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    guard.scale(model(torch.full((3, 4), float("inf"))).sum()).backward()
    guard.step(opt)
    guard.update()
    assert guard.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in state.items())  # step count too


def _train(scaler: LossScaler, opt: torch.optim.Optimizer, model: torch.nn.Module, value: float) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.full((3, 4), value)).sum()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True])
def test_a_long_run_of_skips_is_reported_once_without_a_monitor(fused: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    guard = _guard()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(40):
            _train(guard, opt, model, float("nan"))
        for _ in range(70):  # the fused path reads its streak at the check every 100 updates
            _train(guard, opt, model, 1.0)
    streaks = [w for w in caught if issubclass(w.category, SkipStreakWarning)]
    assert len(streaks) == 1
    assert "optimizer steps in a row were skipped" in str(streaks[0].message)
    assert "HINT" in str(streaks[0].message)


def test_warn_on_skips_false_keeps_the_scaler_quiet() -> None:
    model, opt = _model()
    guard = _guard()
    guard.warn_on_skips = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkipStreakWarning)
        for _ in range(30):
            _train(guard, opt, model, float("nan"))
    with pytest.raises(TypeError, match="warn_on_skips"):
        guard.warn_on_skips = "no"  # type: ignore[assignment]


@pytest.mark.parametrize(("fused", "reads"), [(False, 1), (True, 0)])
@pytest.mark.parametrize("scaler", SCALERS, ids=["guard", "fp16"])
def test_one_step_reads_the_skip_flag_at_most_once(scaler: Any, fused: bool, reads: int) -> None:
    """A non-fused step must read its flag to skip on the host; after that nobody reads it again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    # (torch's single-tensor Adam reads its step counter on the host by itself; SGD reads nothing)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )  # fmt: skip
    s = scaler()
    _train(s, opt, model, 1.0)  # the first step creates the scale and the optimizer state
    with HostReads() as mode:
        _train(s, opt, model, 1.0)
        skipped = s.last_step_skipped if not fused else None
    assert mode.count == reads and skipped in (False, None)
