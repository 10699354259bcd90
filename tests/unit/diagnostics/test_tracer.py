"""Tests for ``amp_plugin.diagnostics._tracer``: the first module to produce inf/NaN, forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_plugin.diagnostics import _tracer as tracer_module
from amp_plugin.diagnostics._tracer import NonFiniteTracer
from tests.unit.diagnostics._models import Boost, GradBoost, Layer, Net, forward_backward


def test_tracer_names_the_module_that_overflows_in_forward() -> None:
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer:
        forward_backward(model)
    record = tracer.forward_record
    assert record is not None
    assert (record.module, record.cls, record.dtype, record.kind, record.origin) == (
        "encoder.layers.1.boost",
        "Boost",
        torch.float16,
        "inf",
        "",
    )
    assert record.message().startswith("encoder.layers.1.boost (Boost, float16) produced inf in forward")
    assert 0 < record.largest_finite <= 65504
    assert "fp32_modules=(Boost,)" in record.hint() and "bf16" in record.hint()
    assert tracer.backward_record is None  # the forward overflow explains the backward that follows


def test_tracer_names_the_module_that_overflows_in_backward() -> None:
    model = Net(Layer(GradBoost()))
    with NonFiniteTracer(model) as tracer:
        forward_backward(model, value=1.0)
    record = tracer.backward_record
    assert tracer.forward_record is None
    assert record is not None
    assert (record.module, record.cls, record.dtype, record.origin) == (
        "encoder.layers.1.boost",
        "GradBoost",
        torch.float16,
        "",
    )
    assert record.what == "gradient w.r.t. its input"
    assert "produced inf in backward" in record.message()
    assert "init_scale" in record.hint()
    report = tracer.report()
    assert report is not None and report.startswith(record.message())


def test_tracer_blames_code_between_submodules() -> None:
    model = Net(Layer(inline_factor=1e5))  # the multiply sits in Layer.forward, not in a submodule
    with NonFiniteTracer(model) as tracer:
        forward_backward(model)
    record = tracer.forward_record
    assert record is not None
    assert record.module == "encoder.layers.1.act"
    assert record.origin == "code in encoder.layers.1 that runs before it"
    assert "first reached encoder.layers.1.act (ReLU, float16) in its input" in record.message()


def test_tracer_blames_the_loss_for_an_overflowing_output_gradient() -> None:
    model = Net()
    with NonFiniteTracer(model) as tracer:
        forward_backward(model, fp16=False, loss_factor=1e38 * 1e38)
    record = tracer.backward_record
    assert record is not None
    assert (record.module, record.origin) == ("<Net>", "the loss (code after the model)")
    assert "precision is not the cause" in record.hint()  # float32 overflow


def test_tracer_names_a_parameter_gradient_that_overflows() -> None:
    # The input needs no gradient, so the only fp16 overflow is the weight gradient x^T @ grad_out.
    model = nn.Sequential(nn.Linear(8, 8))
    with NonFiniteTracer(model) as tracer:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((64, 8), 300.0))
        (out.float().sum() * 100).backward()
    record = tracer.backward_record
    assert record is not None
    assert (record.module, record.what, record.dtype) == (
        "0",
        "gradient of its parameter 'weight'",
        torch.float16,
    )


def test_tracer_leaves_gradients_unchanged_and_inplace_modules_working() -> None:
    model = Net()
    forward_backward(model)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with NonFiniteTracer(model) as tracer:
        forward_backward(model)
    assert tracer.report() is None
    for p, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


def _hook_count(model: nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    return count + sum(len(p._backward_hooks or {}) for p in model.parameters())


def test_detach_removes_every_hook_and_attach_is_idempotent() -> None:
    model = Net(Layer(Boost(1e5)))
    tracer = NonFiniteTracer(model)
    assert _hook_count(model) == 0 and not tracer.attached
    tracer.attach()
    first = _hook_count(model)
    tracer.attach()
    assert _hook_count(model) == first > 0
    tracer.detach()
    assert _hook_count(model) == 0 and not tracer.attached
    forward_backward(model)
    assert tracer.report() is None  # detached: nothing recorded


def test_no_hook_outlives_detach_when_modules_pass_parameters_around() -> None:
    class Positions(nn.Module):  # returns its own parameter: a leaf tensor as a module output
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(2, 8))

        def forward(self) -> torch.Tensor:
            return self.table

    class WithPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = Positions()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x + self.pos()) + self.lin(self.pos.table)  # a parameter as an input too

    model = WithPositions()
    with NonFiniteTracer(model):
        for _ in range(3):
            model(torch.ones(2, 8)).sum().backward()
    assert _hook_count(model) == 0


def test_checks_stop_after_the_first_record_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = tracer_module._is_nonfinite
    monkeypatch.setattr(tracer_module, "_is_nonfinite", lambda t: calls.append(1) or real(t))
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer:
        forward_backward(model)
        assert tracer.forward_record is not None and calls
        calls.clear()
        forward_backward(model)
        assert not calls  # recorded: no more checks, no more host syncs
        tracer.reset()
        assert tracer.forward_record is None
        forward_backward(model)
        assert tracer.forward_record is not None and calls


def test_tracer_checks_forward_under_no_grad() -> None:
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer, torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), 30.0))
    assert tracer.forward_record is not None and tracer.forward_record.module == "encoder.layers.1.boost"


def test_tracer_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"NonFiniteTracer\(model=list\).*HINT"):
        NonFiniteTracer([nn.Linear(2, 2)])  # type: ignore[arg-type]
