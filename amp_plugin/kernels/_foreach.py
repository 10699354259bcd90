"""Reference backend (``"torch"``): torch's own fused multi-tensor ``_foreach`` ops, on CPU and CUDA.

Every launch is per ``(device, dtype)`` group, zero-numel tensors are skipped, and no
operation reads a value back to the host. On a CPU, where torch's multi-tensor ops run one tensor
at a time whatever the dtypes, the unscale is one call over every tensor, without grouping.

**Two CUDA rules of torch's ops** (torch 2.11 to 2.13, ``aten/src/ATen/native/cuda``) that the
contract's "fp32 math with the fp32 factor, rounded once" has to be routed around; each is a
class attribute, so that tests can make CPU tensors follow it (``tests/fakes/cuda_rules.py``):

- :attr:`TorchKernels.unscale_op_lacks`: ``torch._amp_foreach_non_finite_check_and_unscale_`` has no
  bf16 kernel on CUDA (pytorch issue 127176; the CPU one has). A bf16 group there takes the flag
  from one read, a max-abs norm per tensor (``torch._foreach_norm(..., inf)``, which propagates
  NaN) handed to the unscale op as fp32, and is then multiplied as :meth:`TorchKernels.mul_` does.
- :attr:`TorchKernels.mul_rounds_factor_on`: ``torch._foreach_mul_(tensors, factor)`` with a 0-dim
  fp32 factor on the tensors' CUDA device multiplies each tensor by TensorIterator (its multi-tensor
  kernel needs the factor in the tensors' dtype), which casts the factor to an fp16/bf16 tensor's
  dtype first: 0.1 becomes 0.10009765625 in bf16, and 2**-25 becomes 0 in fp16. (On CPU a 0-dim
  CPU tensor is read in fp32.) Half groups there are multiplied instead by torch's unscale op,
  which reads the fp32 factor as it is (fp16: one multi-tensor launch), or, for bf16, by
  ``torch._foreach_mul_`` against a one-element (not 0-dim) factor, which makes fp32 the common
  dtype: one call, in which torch launches one kernel per tensor, because torch has no
  multi-tensor kernel that multiplies bf16 by an fp32 device factor without rounding it.

Power-of-two factors (every scale the default dynamic policy makes, and its inverse) are exact in
fp16 (down to 2**-24) and bf16, so for them either reading gives the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from amp_plugin.kernels import _triton
from amp_plugin.kernels._base import group_by_device_and_dtype, norm_dtype, to_device, untracked

__all__ = ["TorchKernels"]

_GroupNorm = Callable[[list[Tensor], float], Tensor]
CPU = torch.device("cpu")
_CPU_HALF = frozenset({("cpu", torch.float16), ("cpu", torch.bfloat16)})
_HALF = frozenset({torch.float16, torch.bfloat16})


class TorchKernels:
    """Multi-tensor kernels built on ``torch._foreach_*`` and the AMP unscale op.

    Example:
        >>> import torch
        >>> from amp_plugin.kernels import get_kernels
        >>> k = get_kernels("torch")
        >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
        >>> found_inf = torch.zeros(())
        >>> k.unscale_(grads, torch.tensor(0.5), found_inf)
        >>> grads[0].tolist(), found_inf.item()
        ([1.0, 2.0], 1.0)
    """

    name = "torch"
    #: ``(device type, dtype)`` pairs that torch's AMP unscale op has no kernel for.
    unscale_op_lacks: ClassVar[frozenset[tuple[str, torch.dtype]]] = frozenset({("cuda", torch.bfloat16)})
    #: Device types where ``_foreach_mul_`` casts a 0-dim factor there to a half tensor's dtype first.
    mul_rounds_factor_on: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def unscale_(self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
        with untracked():
            if found_inf.is_cpu and self._cpu_op_takes(tensors):
                # The CPU op unscales one tensor at a time, of any dtype, empty ones too: no grouping.
                factor = to_device(inv_scale, CPU)
                torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found_inf, factor)
                return
            for (device, dtype), group in group_by_device_and_dtype(tensors).items():
                factor = to_device(inv_scale, device)
                flag = found_inf if device == found_inf.device else _zero_flag(device)
                if (device.type, dtype) in self.unscale_op_lacks:
                    # Flag first: it is about the inputs, and a finite input can overflow when multiplied.
                    maxima = torch._foreach_norm(group, math.inf, dtype=torch.float32)
                    torch._amp_foreach_non_finite_check_and_unscale_(maxima, flag, factor)
                    self._mul_group(group, factor)
                else:
                    torch._amp_foreach_non_finite_check_and_unscale_(group, flag, factor)
                if flag is not found_inf:
                    torch.maximum(found_inf, to_device(flag, found_inf.device), out=found_inf)

    def _cpu_op_takes(self, tensors: Sequence[Tensor]) -> bool:
        """Whether every tensor is on the CPU, where torch's unscale op has a kernel for every dtype."""
        if not self.unscale_op_lacks.isdisjoint(_CPU_HALF):  # a test's CPU that follows CUDA's rules
            return False
        return all([tensor.is_cpu for tensor in tensors])  # a list: no generator resumed per tensor

    def norm(self, tensors: Sequence[Tensor], norm_type: float = 2.0, exact: bool = False) -> Tensor:
        return _total_norm(tensors, norm_type, _foreach_group_norm if exact else _group_norm)

    def mul_(self, tensors: Sequence[Tensor], factor: Tensor) -> None:
        with untracked():
            for (device, _), group in group_by_device_and_dtype(tensors).items():
                self._mul_group(group, to_device(factor, device))

    def _mul_group(self, group: list[Tensor], factor: Tensor) -> None:
        """``group *= factor`` in fp32 with the fp32 ``factor`` (on the group's device) as it is."""
        device, dtype = group[0].device, group[0].dtype
        if dtype not in _HALF or device.type not in self.mul_rounds_factor_on:
            torch._foreach_mul_(group, factor)
        elif (device.type, dtype) not in self.unscale_op_lacks:
            # The unscale op as a plain multiply; its flag (never read, so never zeroed) is dropped.
            unused = torch.empty((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, unused, factor)
        else:
            # A one-element factor is not a 0-dim "scalar" to type promotion: the common dtype is fp32.
            # A 0-dim tensor cannot take a broadcast (1,) result in place, so it is viewed as (1,).
            targets = [tensor.view(1) if tensor.dim() == 0 else tensor for tensor in group]
            torch._foreach_mul_(targets, [factor.reshape(1)] * len(targets))


def _zero_flag(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


_DOT_MIN_ELEMENTS = 1 << 16


def _total_norm(tensors: Sequence[Tensor], norm_type: float, group_norm: _GroupNorm) -> Tensor:
    groups = group_by_device_and_dtype(tensors)
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    first = next(iter(groups))[0]
    with torch.no_grad():
        partial = [to_device(group_norm(group, norm_type), first) for group in groups.values()]
        if len(partial) == 1:
            return partial[0]
        total: Tensor = torch.linalg.vector_norm(torch.stack(partial), norm_type)
        return total


def _foreach_group_norm(group: list[Tensor], norm_type: float) -> Tensor:
    norms = torch._foreach_norm(group, norm_type, dtype=norm_dtype(group[0].dtype))
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total


def _group_norm(group: list[Tensor], norm_type: float) -> Tensor:
    # On CUDA, one Triton launch reads the whole group, faster than _foreach_norm (kernels._triton).
    # On CPU, torch's fp32 norm reduction is compute-bound: BLAS sdot reads the same bytes about
    # twice as fast and is also more accurate. Both sum in fp32, so the error grows with the length
    # of each partial sum; sdot splits the vector between its threads, so its error shrinks as
    # threads are added, while torch's does not change with the thread count. Relative error on 30M
    # standard-normal elements (torch 2.13, MKL): 6.0e-4 with one thread and 2.1e-4 with two,
    # against 1.7e-3 for torch's reduction: about 3x smaller with one thread, the worst case.
    # Below _DOT_MIN_ELEMENTS the per-tensor calls cost more than the reduction saves.
    tensor = group[0]
    if norm_type == 2.0 and (kernel_norm := _triton.norm(group)) is not None:
        return kernel_norm
    if norm_type != 2.0 or tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        return _foreach_group_norm(group, norm_type)
    if sum(t.numel() for t in group) < _DOT_MIN_ELEMENTS:
        return _foreach_group_norm(group, norm_type)
    squares = [torch.dot(t.view(-1), t.view(-1)) if t.is_contiguous() else t.square().sum() for t in group]
    total: Tensor = torch.stack(squares).double().sum().sqrt().float()
    return total
