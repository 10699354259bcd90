"""Tests for ``amp_plugin.diagnostics._nonfinite``: which parameters' gradients hold inf/NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.diagnostics._nonfinite import nonfinite_gradients
from tests.unit.diagnostics._models import Net, forward_backward


def test_nonfinite_gradients_names_the_poisoned_parameter() -> None:
    model = Net()
    forward_backward(model, fp16=False)
    model.encoder.layers[1].out.weight.grad[3, 4] = float("nan")
    found = nonfinite_gradients(model.named_parameters())
    assert [(g.name, g.kind, g.count) for g in found] == [("encoder.layers.1.out.weight", "nan", 1)]
    assert str(found[0]) == "encoder.layers.1.out.weight (nan in 1 of 64 values, float32)"


def test_nonfinite_gradients_kinds_order_limit_and_missing_grads() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    model[0].bias.grad = None
    model[1].weight.grad[0] = torch.tensor([float("inf"), float("nan")])
    model[2].bias.grad[1] = float("-inf")
    model[2].weight.grad.fill_(3e38)  # huge but finite: its 1-norm overflows
    found = nonfinite_gradients(model)
    assert [(g.name, g.kind) for g in found] == [("1.weight", "inf and nan"), ("2.bias", "inf")]
    assert [g.name for g in nonfinite_gradients(model, limit=1)] == ["1.weight"]
    model.zero_grad()
    assert nonfinite_gradients(model) == []


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [
        (0, ValueError, r"limit=0\) is not allowed here: .*an int >= 1"),
        (-1, ValueError, r"limit=-1\) is not allowed here: .*an int >= 1"),
        (2.5, TypeError, r"limit=2.5\) is not allowed here: .*an int >= 1"),
        (True, TypeError, r"limit=True\) is not allowed here: .*an int >= 1"),
        ("5", TypeError, r"limit='5'\) is not allowed here: .*an int >= 1"),
    ],
)
def test_nonfinite_gradients_rejects_a_bad_limit(limit: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=r"^nonfinite_gradients\(" + match + r"\. HINT: pass limit=5"):
        nonfinite_gradients(nn.Linear(2, 2), limit=limit)


@pytest.mark.parametrize(
    ("named", "match"),
    [
        (lambda m: m.parameters(), r"named_parameters=.*\(name, parameter\) pairs.*"
         r"HINT: pass model\.named_parameters"),
        (lambda m: "weight", r"named_parameters='weight'\) is not allowed"),
        (lambda m: [("weight", 1.0)], r"named_parameters=\.\.\.\) is not allowed here: .*.*pairs; "
         r"got tuple \('weight', 1\.0\)"),
        (lambda m: 3, r"named_parameters=3\) is not allowed"),
    ],
)  # fmt: skip
def test_nonfinite_gradients_refuses_what_is_not_named_parameters(named: Any, match: str) -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad[0] = float("nan")  # unnamed parameters would silently report nothing
    with pytest.raises(TypeError, match=r"^nonfinite_gradients\(" + match):
        nonfinite_gradients(named(model))
