"""Small models whose forward or backward overflows fp16 where a test says, shared by the diagnostics tests.

fp16 autocast on CPU is slow, so every model here is tiny.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Boost(nn.Module):
    """Multiplies by a constant: 1e5 overflows fp16 (max 65504) in forward."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _GradBoostFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e6


class GradBoost(nn.Module):
    """Identity in forward; multiplies the gradient by 1e6 in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradBoostFn.apply(x)


class Layer(nn.Module):
    def __init__(self, boost: nn.Module | None = None, inline_factor: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)  # the in-place case that breaks register_full_backward_hook
        self.boost = boost if boost is not None else Boost()
        self.out = nn.Linear(8, 8)
        self.inline_factor = inline_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.boost(self.lin(x)) * self.inline_factor))


class Net(nn.Module):
    def __init__(self, middle: Layer | None = None) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Layer(), middle or Layer(), Layer()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder.layers:
            x = layer(x)
        return self.head(x)


def forward_backward(
    model: nn.Module, *, fp16: bool = True, loss_factor: float = 1.0, value: float = 30.0
) -> None:
    """One forward (under fp16 autocast unless told otherwise) and backward on a constant batch."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(torch.full((2, 8), value))
    (out.float().sum() * loss_factor).backward()
