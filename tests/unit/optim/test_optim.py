"""Optimizer helpers: unwrapping, gradient tensors to unscale, and the fused-step attribute contract."""

from __future__ import annotations

import inspect
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from amp_plugin._optim import (
    gradients_to_unscale,
    handles_unscaling,
    step_with_amp_attributes,
    takes_grad_scaler,
    unwrap_optimizer,
)


def _sgd(**kwargs: object) -> torch.optim.SGD:
    return torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1, **kwargs)  # type: ignore[arg-type]


def test_unwrap_follows_optimizer_and_private_optimizer_attributes() -> None:
    inner = _sgd()

    class Outer:
        def __init__(self, wrapped: object) -> None:
            self._optimizer = wrapped

    class Middle:
        def __init__(self, wrapped: object) -> None:
            self.optimizer = wrapped

    assert unwrap_optimizer(Outer(inner)) is inner
    assert unwrap_optimizer(Middle(inner)) is inner
    with pytest.raises(TypeError, match="HINT"):
        unwrap_optimizer(object())


def test_handles_unscaling_only_for_fused_optimizers() -> None:
    assert not handles_unscaling(_sgd())
    assert handles_unscaling(_sgd(fused=True))


def test_sparse_gradients_contribute_their_values_and_fp16_ones_are_coalesced() -> None:
    emb = nn.Embedding(5, 2, sparse=True).half()
    emb(torch.tensor([1, 1, 3])).float().sum().backward()
    assert not emb.weight.grad.is_coalesced()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    (values,) = gradients_to_unscale(opt)
    assert emb.weight.grad.is_coalesced() and values.shape == (2, 2)


def test_amp_attributes_are_removed_even_when_the_step_raises() -> None:
    opt = _sgd(fused=True)

    def broken_step(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    opt.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        step_with_amp_attributes(opt, opt, torch.tensor(2.0), torch.zeros(()))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_whether_a_step_takes_grad_scaler_is_read_once_per_step_function() -> None:
    class Old(torch.optim.SGD):  # torch's older fused contract: the step asks for the scaler
        def step(self, closure: Any = None, grad_scaler: Any = None) -> None:
            return None

    class New(torch.optim.SGD):  # a step function of its own: nothing read for it before this test
        def step(self, closure: Any = None) -> None:
            return None

    params = [torch.nn.Parameter(torch.ones(2))]
    optimizers = [Old(params, lr=0.1), Old(params, lr=0.2), New(params, lr=0.1)]
    with mock.patch("inspect.signature", wraps=inspect.signature) as signature:
        answers = [takes_grad_scaler(opt) for opt in optimizers for _ in range(3)]
    assert answers == [True] * 6 + [False] * 3
    assert signature.call_count == 2  # one per step function, however many optimizers and steps
