"""NVIDIA Apex backend: the fused multi-tensor kernels of Apex's compiled ``amp_C`` extension.

``amp_C`` is imported when :class:`ApexKernels` is constructed (see :func:`~amp_plugin.kernels.get_kernels`),
never when this module is imported. The semantics are those of
:mod:`amp_plugin.kernels._base`; what follows is where this backend runs ``amp_C`` and why.

**The host-sync question.** ``amp_C``'s kernel that multiplies (``multi_tensor_scale``) takes
the factor as a C ``float``: a Python number, read on the host
before the launch. The contract passes the factor as a tensor. When that tensor lives on the GPU
(as the loss scale does, like ``torch.amp.GradScaler``'s), reading it is a device-to-host sync: the
host stalls until the whole backward pass has run before it can launch anything. The contract
forbids that, so the factor's location decides:

- factor on the host (a one-element fp32 CPU tensor, not the target of a copy still in flight):
  its value is a memory read, not a sync, and ``unscale_`` and ``mul_`` launch ``amp_C``;
- factor on a device: they run the torch backend, which reads the factor on the device. For fp32
  and fp16 that costs nothing: torch's multi-tensor op makes the same single read+write pass. For
  bf16 on CUDA it is the torch backend's bf16 route (:mod:`amp_plugin.kernels._foreach`: a max-abs
  read for the flag, then one kernel per tensor), because ``amp_C`` cannot take a device factor.

``norm`` (``norm_type=2``) takes no factor. It runs the one-launch Triton kernel of
:mod:`amp_plugin.kernels._triton` where Triton imports (on an H200 it read 400M fp32 gradients in
0.44 ms, where ``multi_tensor_l2norm`` took 0.78 ms), else ``multi_tensor_l2norm``. So with a
scale kept on the GPU, that kernel serves the norm (clipping's norm, the fused clipping path) and
torch serves the multiplications; a scaler that keeps a host copy of its scale gets ``amp_C``
for both multiplications, still without a sync.

**Per tensor, the torch backend takes over** for tensors that ``amp_C`` cannot launch on: not on
a device type in :attr:`ApexKernels.device_types` (CUDA), a dtype other than fp16/bf16/fp32
(``amp_C`` has no fp64 kernels), or a layout that is neither contiguous nor channels-last
contiguous (``amp_C`` walks raw memory and refuses such tensors). Launches are per
``(device, dtype)`` group, zero-numel tensors are dropped, and an empty group launches nothing.

**Numerics against the torch backend** (the oracle):

- ``multi_tensor_scale`` multiplies by the fp32 factor in fp32, rounds once and flags non-finite
  *inputs*: the same bits and the same ``found_inf`` as the torch backend (bf16 included), except
  that Apex builds ``amp_C`` with ``--use_fast_math``, so fp32 subnormal operands and products
  (below 2**-126, which includes every bf16 subnormal) flush to a zero of the same sign. fp16
  values are never fp32 subnormals; an fp16 product flushes only when the factor is tiny.
- ``multi_tensor_l2norm`` accumulates squares in fp32. A non-finite input makes the result
  non-finite (partial sums are non-negative, so inf/NaN reaches the total); its flag is not used,
  because it also fires when a finite fp32/bf16 square overflows (values above about 1.8e19),
  which is not an inf in the gradients. For the same reason a norm above ~1.8e19 is inf here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from amp_plugin import _imports
from amp_plugin.kernels import _triton
from amp_plugin.kernels._base import group_by_device_and_dtype, to_device
from amp_plugin.kernels._foreach import TorchKernels

__all__ = ["ApexKernels"]

_AMP_C_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

_Groups = dict[tuple[torch.device, torch.dtype], list[Tensor]]


class ApexKernels:
    """Multi-tensor kernels on Apex ``amp_C``, with the torch backend for what ``amp_C`` cannot run.

    Raises:
        ImportError: ``amp_C`` or ``apex.multi_tensor_apply`` does not import (with a build hint).

    Example:
        >>> sorted(ApexKernels.device_types)  # tensors elsewhere go to the torch backend
        ['cuda']
        >>> from amp_plugin.kernels import get_kernels
        >>> k = get_kernels("apex", "cuda")  # doctest: +SKIP
        >>> grads = [torch.full((3,), 4.0, device="cuda")]  # doctest: +SKIP
        >>> k.norm(grads).item()  # doctest: +SKIP
        6.928203105926514
    """

    name = "apex"
    #: Device types whose tensors go to ``amp_C``; tests widen it to run a pure-torch double on CPU.
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def __init__(self) -> None:
        self._amp_c, self._applier = _imports.import_amp_c()
        self._torch = TorchKernels()

    def unscale_(self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
        scale = _host_value(inv_scale)
        if scale is None:
            self._torch.unscale_(tensors, inv_scale, found_inf)
            return
        groups, rest = self._split(tensors)
        self._torch.unscale_(rest, inv_scale, found_inf)
        with torch.no_grad():
            for group in groups.values():
                self._scale(group, scale, found_inf)

    def norm(self, tensors: Sequence[Tensor], norm_type: float = 2.0, exact: bool = False) -> Tensor:
        if norm_type != 2 or exact:  # torch's bit-exact recipe is torch's own
            return self._torch.norm(tensors, norm_type, exact)
        first = _first_device(tensors)
        if first is None:
            return torch.zeros((), dtype=torch.float32)
        groups, rest = self._split(tensors)
        with torch.no_grad():
            partials = [self._l2norm(group) for group in groups.values()]
            if rest:
                partials.append(self._torch.norm(rest, 2.0))
            return _total_l2(partials, first)

    def mul_(self, tensors: Sequence[Tensor], factor: Tensor) -> None:
        value = _host_value(factor)
        if value is None:
            self._torch.mul_(tensors, factor)
            return
        groups, rest = self._split(tensors)
        self._torch.mul_(rest, factor)
        with torch.no_grad():
            for group in groups.values():
                self._scale(group, value, found_inf=None)

    def _split(self, tensors: Sequence[Tensor]) -> tuple[_Groups, list[Tensor]]:
        """Non-empty tensors ``amp_C`` can launch on, grouped by (device, dtype), and the rest."""
        launchable: list[Tensor] = []
        rest: list[Tensor] = []
        for tensor in tensors:
            if tensor.numel():
                (launchable if self._launchable(tensor) else rest).append(tensor)
        return group_by_device_and_dtype(launchable), rest

    def _launchable(self, tensor: Tensor) -> bool:
        return (
            tensor.device.type in self.device_types
            and tensor.dtype in _AMP_C_DTYPES
            and (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last))
        )

    def _scale(self, group: list[Tensor], scale: float, found_inf: Tensor | None) -> None:
        flag = _zero_flag(group[0].device)
        self._applier(self._amp_c.multi_tensor_scale, flag, [group, group], scale)
        if found_inf is not None:
            _fold_flag(flag, found_inf)

    def _l2norm(self, group: list[Tensor]) -> Tensor:
        if (total := _triton.norm(group)) is not None:  # faster than multi_tensor_l2norm (kernels._triton)
            return total
        # The flag is dropped: it also fires on finite squares that overflow fp32 (see module docstring).
        result: tuple[Tensor, Any] = self._applier(
            self._amp_c.multi_tensor_l2norm, _zero_flag(group[0].device), [group], False
        )
        return result[0].reshape(())


def _host_value(scalar: Tensor) -> float | None:
    """The value of a one-element fp32 CPU tensor (a memory read, no sync); ``None`` for any other."""
    if scalar.device.type != "cpu" or scalar.dtype != torch.float32 or scalar.numel() != 1:
        return None
    return float(scalar.item())


def _first_device(tensors: Sequence[Tensor]) -> torch.device | None:
    return next((tensor.device for tensor in tensors if tensor.numel()), None)


def _zero_flag(device: torch.device) -> Tensor:
    # amp_C only ever sets its flag to 1, so every launch gets a zeroed one.
    return torch.zeros(1, dtype=torch.int32, device=device)


def _fold_flag(flag: Tensor, found_inf: Tensor) -> None:
    """``found_inf = max(found_inf, flag)`` on ``found_inf``'s device, without reading either."""
    hit = to_device(flag, found_inf.device).to(found_inf.dtype)
    torch.maximum(found_inf, hit.view_as(found_inf), out=found_inf)


def _total_l2(partials: list[Tensor], device: torch.device) -> Tensor:
    moved = [to_device(partial, device) for partial in partials]
    if len(moved) == 1:
        return moved[0]
    total: Tensor = torch.linalg.vector_norm(torch.stack(moved), 2)
    return total
