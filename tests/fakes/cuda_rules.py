"""A CPU stand-in for the two CUDA rules of torch's ops that the torch kernel backend routes around.

Read from torch's CUDA sources (``aten/src/ATen/native/cuda``), torch 2.11 to 2.13, and seen on an
H200 (``shared/gpu/evidence-2026-11``):

- ``torch._amp_foreach_non_finite_check_and_unscale_`` dispatches fp32, fp64 and fp16 only
  (``AT_DISPATCH_FLOATING_TYPES_AND_HALF`` in ``AmpKernels.cu``): a bf16 tensor raises
  ``NotImplementedError`` (pytorch issue 127176). The CPU kernel has bf16.
- ``torch._foreach_mul_(tensors, factor)`` with a 0-dim ``factor`` on the tensors' CUDA device takes
  its multi-tensor kernel only when the factor's dtype is the tensors' (``ForeachBinaryOpScalarTensor.cu``);
  otherwise each tensor is multiplied by TensorIterator, whose common dtype for an fp16/bf16 tensor
  and a 0-dim fp32 tensor is the half dtype: the factor is rounded to it before the fp32 multiply
  (0.1 becomes 0.10009765625 in bf16). A 0-dim *CPU* tensor is read as an fp32 scalar instead, which
  is what the CPU does with its own 0-dim tensors.

:func:`cuda_rules_on_cpu` makes the CPU follow both rules for the duration, and makes
:class:`~amp_plugin.kernels._foreach.TorchKernels` route CPU tensors the way it routes CUDA ones, so
that the CUDA routes run, and are checked against the CPU routes, without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from amp_plugin.kernels._foreach import TorchKernels

__all__ = ["cuda_rules_on_cpu"]

_HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def cuda_rules_on_cpu() -> Iterator[None]:
    """Give CPU tensors CUDA's bf16 gap in the unscale op and CUDA's rounding of a device factor.

    ``raising=False``: the two routing rules are class attributes of ``TorchKernels``; setting them
    on a class without them is harmless, and lets the tests run (and fail) against older code.
    """
    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    foreach_mul = torch._foreach_mul_

    def unscale_without_bf16(tensors: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
        if any(tensor.dtype == torch.bfloat16 for tensor in tensors):
            raise NotImplementedError(
                "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
            )
        unscale(tensors, found_inf, inv_scale)

    def mul_rounding_a_device_factor(tensors: Sequence[Tensor], other: Any) -> None:
        if not (isinstance(other, Tensor) and other.dim() == 0):
            foreach_mul(tensors, other)
            return
        for tensor in tensors:  # CUDA's per-tensor route when the dtypes differ
            rounds = tensor.dtype in _HALF and other.dtype != tensor.dtype
            foreach_mul([tensor], other.to(tensor.dtype) if rounds else other)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unscale_without_bf16)
        patch.setattr(torch, "_foreach_mul_", mul_rounding_a_device_factor)
        lacks = getattr(TorchKernels, "unscale_op_lacks", frozenset())
        patch.setattr(TorchKernels, "unscale_op_lacks", lacks | {("cpu", torch.bfloat16)}, raising=False)
        rounds = getattr(TorchKernels, "mul_rounds_factor_on", frozenset())
        patch.setattr(TorchKernels, "mul_rounds_factor_on", rounds | {"cpu"}, raising=False)
        yield
