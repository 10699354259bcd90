"""The contract every kernel backend fulfils.

The scaler and the clipping code need only three multi-tensor operations. A backend
implements them for lists of dense gradient tensors that may mix devices and dtypes
and may contain zero-numel tensors; the backend groups and filters as its launchers
require. None of the operations synchronises the host with the device, and every one
works for every dtype below on CPU and CUDA (bf16 on CUDA included).

Semantics (the same on every device; tests check each backend against fp64 math rounded the
way this contract says, ``tests/unit/kernels/_reference.py``):

``unscale_(tensors, inv_scale, found_inf)``
    Multiply every tensor in place by ``inv_scale`` (an fp32 scalar tensor on any device): each
    element times the fp32 factor as it is, in fp32, and that fp32 product rounded to the tensor's
    dtype (fp64 tensors: in fp64). If any *input* element is inf or NaN, write ``1.0`` into
    ``found_inf`` (an fp32 scalar tensor); a finite input whose product overflows does not count.
    ``found_inf`` is never reset: the caller zeroes it. Bit-identical to
    ``torch._amp_foreach_non_finite_check_and_unscale_`` where torch has that op for the dtype.
    On CUDA it has no bf16 kernel (pytorch issue 127176): the torch backend gives bf16 the same
    bits there by another route (:mod:`amp_plugin.kernels._foreach`).

``norm(tensors, norm_type, exact=False)``
    The total ``norm_type``-norm of all tensors together, accumulated and returned in
    fp32 (an fp16 gradient norm above 65504 is finite here; fp64 where a tensor is fp64), as
    a 0-dim tensor on the device of the first tensor (CPU when the list is empty, where it is
    0). Any inf or NaN input makes the result non-finite, so a norm doubles as an inf check.
    With ``exact=True`` the result is bit-identical to the total norm that
    ``torch.nn.utils.clip_grad_norm_`` computes for fp32 and fp64 tensors (the torch backend's
    recipe; for fp16/bf16 ones torch's norm is in their dtype, which overflows above 65504 in
    fp16); otherwise a backend may use any faster fp32 reduction.

``mul_(tensors, factor)``
    Multiply every tensor in place by ``factor`` (an fp32 scalar tensor on any device), with the
    arithmetic of ``unscale_``: the fp32 factor as it is, fp32 math, one rounding to the dtype.
    That is not what ``torch._foreach_mul_`` (nor so ``torch.nn.utils.clip_grad_norm_``) does on
    CUDA with a factor on the device: it casts the factor to an fp16/bf16 tensor's dtype first
    (TensorIterator's common dtype), so a bf16 gradient times 0.1 is multiplied by 0.10009765625.
    Power-of-two factors, among them every scale the default dynamic policy makes and its
    inverse, are exact in both dtypes (fp16 down to 2**-24), so for them both give the same bits.

One difference between backends remains: where Apex's ``amp_C`` multiplies (a factor on the host,
:mod:`amp_plugin.kernels._apex`), it is built with ``--use_fast_math``, so fp32 subnormal operands
and products (below 2**-126, every bf16 subnormal among them) become zero.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Kernels", "group_by_device_and_dtype", "norm_dtype", "per_tensor_norms", "to_device", "untracked"]


@runtime_checkable
class Kernels(Protocol):
    """Multi-tensor operations used by :class:`~amp_plugin.LossScaler` and clipping.

    Example:
        >>> from amp_plugin.kernels import get_kernels
        >>> isinstance(get_kernels("torch"), Kernels)
        True
    """

    name: str

    def unscale_(self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None: ...

    def norm(self, tensors: Sequence[Tensor], norm_type: float = 2.0, exact: bool = False) -> Tensor: ...

    def mul_(self, tensors: Sequence[Tensor], factor: Tensor) -> None: ...


def group_by_device_and_dtype(
    tensors: Sequence[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """Group tensors by ``(device, dtype)`` in first-seen order, dropping zero-numel ones.

    Example:
        >>> groups = group_by_device_and_dtype([torch.ones(2), torch.ones(0), torch.ones(3).half()])
        >>> [(device.type, dtype, len(group)) for (device, dtype), group in groups.items()]
        [('cpu', torch.float32, 1), ('cpu', torch.float16, 1)]
    """
    if tensors:  # the usual case, one device and one dtype and no empty tensor, without a dict per tensor
        device, dtype = tensors[0].device, tensors[0].dtype
        for t in tensors:  # a loop, not all(...): a step calls this several times, on every tensor
            if t.dtype is not dtype or not t.numel() or t.device != device:
                break
        else:
            return {(device, dtype): list(tensors)}
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        if tensor.numel():
            groups[(tensor.device, tensor.dtype)].append(tensor)
    return dict(groups)


def norm_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """What torch's norms of ``dtype`` tensors accumulate in and return here: fp32 (a half norm would
    overflow at the half type's largest value), or ``None``, their own dtype, for fp64 ones (torch
    computes no fp32 norm of an fp64 tensor, and an fp64 norm may lie beyond fp32's range).

    Example:
        >>> norm_dtype(torch.float16), norm_dtype(torch.float64)
        (torch.float32, None)
    """
    return None if dtype == torch.float64 else torch.float32


def per_tensor_norms(tensors: list[Tensor], norm_type: float) -> list[Tensor]:
    """The norm of each tensor, of any mix of dtypes, each in its :func:`norm_dtype`: one launch per dtype.

    A group of one dtype (from :func:`group_by_device_and_dtype`) needs only
    ``torch._foreach_norm(group, norm_type, dtype=norm_dtype(group[0].dtype))``.

    Example:
        >>> tensors = [torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float64)]
        >>> [norm.dtype for norm in per_tensor_norms(tensors, 2)]
        [torch.float32, torch.float64]
    """
    by_dtype: dict[torch.dtype | None, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(norm_dtype(tensor.dtype), []).append(i)
    norms: list[Tensor] = list(tensors)  # each replaced by its norm below
    for dtype, indices in by_dtype.items():
        computed = torch._foreach_norm([tensors[i] for i in indices], norm_type, dtype=dtype)
        for i, norm in zip(indices, computed, strict=True):
            norms[i] = norm
    return norms


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``, copied without a host sync where that is safe.

    A non-blocking copy into CPU memory may still be in flight when the host reads it next,
    so only copies onto an accelerator are made non-blocking.

    Example:
        >>> to_device(torch.ones(2), torch.device("cpu"))
        tensor([1., 1.])
    """
    if tensor.device == device:  # what .to() would return, without its argument parsing
        return tensor
    return tensor.to(device, non_blocking=device.type != "cpu")


class _GradOff:
    """Grad mode off inside, as ``torch.no_grad()``, set directly: about a fifth of its cost per use."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self._before)


def untracked() -> AbstractContextManager[Any]:
    """A context in which in-place writes record no autograd history: ``torch.no_grad()``'s effect.

    The kernels write gradients in place several times a step, and gradients of a
    ``create_graph=True`` backward require grad. ``torch.no_grad()`` builds two objects per use;
    this sets the grad mode itself (``torch.no_grad()`` under ``torch.compile``, which knows it).

    Example:
        >>> weight = torch.ones(2, requires_grad=True)
        >>> with untracked():
        ...     (weight * 2).requires_grad
        False
        >>> torch.is_grad_enabled()
        True
    """
    return torch.no_grad() if torch.compiler.is_compiling() else _GradOff()
