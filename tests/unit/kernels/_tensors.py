"""Gradient-like tensors, a backend under test, and the checks the kernel tests share."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import cycle

import pytest
import torch
from torch import Tensor

from amp_plugin.kernels import Kernels

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
CPU = torch.device("cpu")
SMALL_CHUNK = 64  # the double then sums several chunks per tensor, as amp_C's blocks do

MIXES = {"fp32": (FP32,), "fp16": (FP16,), "bf16": (BF16,), "mixed": (FP16, FP32, BF16)}
SHAPES = ((5,), (10, 13), (1,), (0,), (257,))  # zero-numel near the end; the last one spans several chunks
POSITIONS = {"first": (0, 0), "middle": (1, 65), "last": (-1, -1)}  # (tensor, flat element)
NONFINITE = [
    pytest.param(None, None, id="finite"),
    *(pytest.param(where, math.inf, id=f"inf-{where}") for where in POSITIONS),
    *(pytest.param(where, math.nan, id=f"nan-{where}") for where in POSITIONS),
    pytest.param("middle", -math.inf, id="-inf-middle"),
]
REAL_APEX = [pytest.mark.cuda, pytest.mark.apex]


@dataclass(frozen=True)
class Backend:
    kernels: Kernels
    device: torch.device  # where the gradients live
    scalar_device: torch.device  # where inv_scale / factor live
    flush: bool = False  # fp32 subnormals flush to zero (real amp_C on CUDA, built with --use_fast_math)
    unscale_op_has_bf16: bool = True  # torch's unscale op has a bf16 kernel there (CUDA's has none)

    def has_unscale_op(self, tensor: Tensor) -> bool:
        """Whether torch's ``_amp_foreach_non_finite_check_and_unscale_`` runs on ``tensor`` here."""
        return tensor.dtype != BF16 or self.unscale_op_has_bf16

    def scalar(self, value: float) -> Tensor:
        return torch.tensor(value, dtype=FP32, device=self.scalar_device)

    def zeros(self) -> Tensor:
        return torch.zeros((), dtype=FP32, device=self.device)


def make_grads(
    mix: Sequence[torch.dtype],
    device: torch.device = CPU,
    where: str | None = None,
    value: float | None = None,
    magnitude: float = 1000.0,
) -> list[Tensor]:
    """Scaled-gradient-like tensors cycling through ``mix``; ``value`` planted at ``where``."""
    gen = torch.Generator().manual_seed(1234)
    grads = [
        (torch.randn(shape, generator=gen) * magnitude).to(dtype) for shape, dtype in zip(SHAPES, cycle(mix))
    ]
    if where is not None and value is not None:
        tensor, element = POSITIONS[where]
        grads[tensor].view(-1)[element] = value
    return [grad.to(device) for grad in grads]


def clone(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [tensor.clone() for tensor in tensors]


def assert_bit_identical(actual: Sequence[Tensor], expected: Sequence[Tensor]) -> None:
    as_int = {FP16: torch.int16, BF16: torch.int16, FP32: torch.int32, FP64: torch.int64}
    for got, want in zip(actual, expected, strict=True):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        got, want = got.cpu(), want.cpu()
        nan = got.isnan()
        assert torch.equal(nan, want.isnan())
        assert torch.equal(got[~nan].view(as_int[got.dtype]), want[~nan].view(as_int[want.dtype]))


@contextlib.contextmanager
def recorded_host_reads() -> Iterator[list[Tensor]]:
    """Every tensor whose value Python reads back (``.item()``, ``float(t)``, ``if t``, ...)."""
    reads: list[Tensor] = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            original = getattr(torch.Tensor, name)

            def spy(self: Tensor, *args: object, _original: object = original) -> object:
                reads.append(self)
                return _original(self, *args)  # type: ignore[operator]

            patch.setattr(torch.Tensor, name, spy)
        yield reads
