"""Gradient clipping that always acts on unscaled gradients.

The gradients in memory may still carry a factor (the loss scale before unscaling, or a
clip factor folded into a fused optimizer's ``grad_scale``). The functions here take that
factor into account instead of unscaling first, so a clip costs one read (the norm of
the gradients as they are) plus, at most, one read+write (one combined multiply):
three passes instead of torch's five (unscale r+w, norm r, clip r+w).

Scaling does not change which elements are finite, and ``||s * g|| == s * ||g||`` for
every norm, so the norm of the still-scaled gradients divided by the factor is the
unscaled norm (to fp32 rounding), and it is non-finite exactly when some gradient is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from amp_plugin.kernels import Kernels
from amp_plugin.kernels._base import group_by_device_and_dtype, norm_dtype, to_device, untracked

__all__ = [
    "ClipResult",
    "clip_coefficient",
    "clip_grad_norm_",
    "gradients",
    "nonfinite",
    "nonfinite_and_norm",
]

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds the same to the norm


class ClipResult(NamedTuple):
    """What a norm clip did (returned by :func:`clip_grad_norm_`).

    Example:
        >>> from amp_plugin.kernels import get_kernels
        >>> res = clip_grad_norm_(get_kernels("torch"), [torch.tensor([3.0, 4.0])], 10.0)
        >>> res.total_norm.item(), res.found_inf.item(), res.grad_scale
        (5.0, 0.0, None)

    Attributes:
        total_norm: the total norm of the unscaled gradients before clipping (fp32, 0-dim).
        found_inf: ``1.0`` where the unscaled norm is non-finite, else ``0.0`` (fp32, 0-dim).
        grad_scale: the factor the gradients in memory still carry after the clip, or
            ``None`` when they now hold the unscaled, clipped values.
    """

    total_norm: Tensor
    found_inf: Tensor
    grad_scale: Tensor | None


def gradients(param_groups: Iterable[dict[str, object]]) -> list[Tensor]:
    """The dense gradient tensors of an optimizer's parameter groups, in group order.

    Sparse gradients are rejected: neither the fused kernels nor the fold path support them.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> [tuple(g.shape) for g in gradients(torch.optim.SGD(model.parameters(), lr=0.1).param_groups)]
        [(1, 2), (1,)]
    """
    grads: list[Tensor] = []
    for group in param_groups:
        for param in group["params"]:  # type: ignore[attr-defined]
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise TypeError(
                    "amp_plugin does not clip sparse gradients or take their norm (a parameter of shape "
                    f"{tuple(param.shape)} has a sparse .grad). HINT: use a dense embedding "
                    "(sparse=False) or torch.amp.GradScaler for this model."
                )
            grads.append(grad)
    return grads


def nonfinite(grads: Sequence[Tensor], one: Tensor) -> Tensor:
    """``1.0`` where a gradient element is inf/NaN, else ``0.0`` (fp32, 0-dim): one read, no write.

    The inf check of a step that clips nothing (the guard's, a fused optimizer's): torch's
    per-tensor norms (one multi-tensor launch per device and dtype, for every floating dtype on
    every device) and torch's AMP inf check over those norms (one more launch), into a flag
    made next to ``one``: three launches where a total norm and a comparison take six. A norm
    is non-finite exactly when an element is, or when it overflows fp32 (above about 1.8e19),
    which counts as an overflow too.

    Args:
        grads: the gradient tensors (local shards, for sharded ones: the flag is this rank's).
        one: an fp32 ``1.0`` on the device the flag is wanted on (e.g. a guard's scale); it is
            the check's factor, so no tensor is made for it per step.

    Example:
        >>> nonfinite([torch.tensor([1.0, float("inf")]), torch.ones(2)], torch.ones(()))
        tensor(1.)
    """
    return nonfinite_and_norm(grads, one, total=False)[0]


def nonfinite_and_norm(
    grads: Sequence[Tensor], one: Tensor, total: bool = True, found_inf: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """:func:`nonfinite`, and the total 2-norm of ``grads`` from the same per-tensor norms (no more reads).

    The total costs two launches over the per-tensor norms (a stack and a norm), none over the
    gradients. ``total=False`` skips it (``None``). The norm is of the gradients as they are in
    memory (still scaled, where they are) and next to ``one``. An existing flag ``found_inf``
    (next to ``one``) is set in place where ``grads`` hold an inf/NaN, and returned: a later check
    folded into an earlier one without a launch of its own.

    Example:
        >>> found_inf, norm = nonfinite_and_norm([torch.tensor([3.0]), torch.tensor([4.0])], torch.ones(()))
        >>> found_inf.item(), norm.item()
        (0.0, 5.0)
    """
    if found_inf is None:
        found_inf = torch.zeros((), dtype=torch.float32, device=one.device)
    total_norm: Tensor | None = None
    with torch.no_grad():
        norms = [
            norm if norm.device == one.device else to_device(norm, one.device)
            for (_, dtype), group in group_by_device_and_dtype(grads).items()
            for norm in torch._foreach_norm(group, 2.0, dtype=norm_dtype(dtype))
        ]
        if norms:
            torch._amp_foreach_non_finite_check_and_unscale_(norms, found_inf, one)
        if total:
            stacked = torch.stack(norms) if norms else torch.zeros(1, device=one.device)
            total_norm = torch.linalg.vector_norm(stacked)
    return found_inf, total_norm


def clamp_(grads: Sequence[Tensor], clip_value: float) -> None:
    """Clamp every element of ``grads`` to ``[-clip_value, clip_value]`` in place (NaN stays NaN).

    The arithmetic of ``torch.nn.utils.clip_grad_value_`` (a ``clamp_min_`` and a ``clamp_max_``),
    on the gradient tensors themselves (local shards, for sharded ones): two multi-tensor launches
    per device and dtype, without collecting the gradients from the parameters again.

    Example:
        >>> grads = [torch.tensor([-3.0, 0.5, float("nan")])]
        >>> clamp_(grads, 1.0)
        >>> grads[0].tolist()
        [-1.0, 0.5, nan]
    """
    if not grads:
        return
    # The CPU runs multi-tensor ops one tensor at a time, whatever their dtypes: no grouping to pay for.
    groups = [list(grads)] if grads[0].device.type == "cpu" else group_by_device_and_dtype(grads).values()
    with untracked():
        for group in groups:
            torch._foreach_clamp_min_(group, -clip_value)
            torch._foreach_clamp_max_(group, clip_value)


_REWRITE_MAX_ELEMENTS = 1 << 23


def rewrite_pays(grads: Sequence[Tensor], found_inf: Tensor) -> bool:
    """Whether the inf check of ``grads`` costs less as an unscale by 1 than as :func:`nonfinite`'s norms.

    On a CPU, up to 8M elements in all: the CPU computes the per-tensor norms one tensor at a time,
    while torch's AMP check is one launch; above that size its write costs more than the norms'
    read. Only for gradients a caller has written already (an unscale): multiplying by 1 leaves
    every value as it was, ``-0.0``, subnormals and NaN included, but it is a write.

    Example:
        >>> flag = torch.zeros(())
        >>> rewrite_pays([torch.ones(3)], flag), rewrite_pays([torch.ones(1 << 24)], flag)
        (True, False)
    """
    if not found_inf.is_cpu:
        return False
    elements = 0
    for grad in grads:
        if not grad.is_cpu:
            return False
        elements += grad.numel()
    return elements <= _REWRITE_MAX_ELEMENTS


def _flag(norm: Tensor) -> Tensor:
    """``1.0`` where a norm (>= 0, or inf/NaN) is inf/NaN, else ``0.0``: two launches (``0 * norm`` is
    NaN exactly for inf/NaN), where ``~isfinite`` takes five."""
    flag = torch.mul(norm, 0.0).nan_to_num_(nan=1.0)
    return flag if flag.dtype == torch.float32 else flag.float()  # an fp64 gradient's norm is fp64


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as in ``torch.nn.utils.clip_grad_norm_``; 1 for inf/NaN.

    The same bits as torch's for a finite norm. A non-finite one (its step is skipped) leaves the
    gradients as they are, where torch's factor (0 or NaN) would turn every gradient into 0 or NaN
    and hide which parameter held the inf/NaN from the forensics that look at them afterwards.

    Example:
        >>> clip_coefficient(torch.tensor(4.0), 1.0), clip_coefficient(torch.tensor(0.5), 1.0)
        (tensor(0.2500), tensor(1.))
        >>> inf, nan = torch.tensor(float("inf")), torch.tensor(float("nan"))
        >>> clip_coefficient(inf, 1.0), clip_coefficient(nan, 0.5)
        (tensor(1.), tensor(1.))
    """
    stand_in = max_norm if max_norm > 0 else 1.0  # max_norm / stand_in == 1
    return torch.clamp(max_norm / torch.nan_to_num(total_norm + _EPS, nan=stand_in, posinf=stand_in), max=1.0)


def clip_grad_norm_(
    kernels: Kernels,
    grads: Sequence[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    grad_scale: Tensor | None = None,
    fold: bool = False,
    error_if_nonfinite: bool = False,
) -> ClipResult:
    """Clip ``grads`` so that their unscaled total norm is at most ``max_norm``.

    Args:
        kernels: the kernel backend.
        grads: the gradient tensors, as they are in memory.
        max_norm: the largest allowed total norm of the unscaled gradients.
        norm_type: the order of the norm (``float("inf")`` for the max norm).
        grad_scale: the factor ``grads`` still carry (``None``: already unscaled).
        fold: leave the gradients untouched and return the combined factor instead, for an
            optimizer that divides by ``grad_scale`` inside its fused step.
        error_if_nonfinite: raise when the norm is inf/NaN (this synchronises the host).

    Returns:
        The unscaled norm, the inf flag, and the factor the gradients still carry.

    Example:
        >>> import torch
        >>> from amp_plugin.kernels import get_kernels
        >>> grads = [torch.tensor([30.0, 40.0])]  # unscaled [3, 4] under a scale of 10
        >>> res = clip_grad_norm_(get_kernels("torch"), grads, 1.0, grad_scale=torch.tensor(10.0))
        >>> round(res.total_norm.item(), 4), [round(g, 4) for g in grads[0].tolist()]
        (5.0, [0.6, 0.8])
    """
    # Gradients already unscaled take torch's own recipe, so that the norm is bit-identical to
    # unscale_ + torch.nn.utils.clip_grad_norm_'s (the clipped gradients too, except fp16/bf16 ones on
    # CUDA, whose factor torch rounds: kernels.base); scaled ones take the backend's fastest norm.
    norm_in_memory = kernels.norm(grads, norm_type, exact=grad_scale is None)
    total_norm = norm_in_memory if grad_scale is None else norm_in_memory / grad_scale.to(norm_in_memory)
    # Non-finite when a gradient is inf/NaN, and also when unscaling by a scale below 1 overflows.
    found_inf = _flag(total_norm)
    if error_if_nonfinite and bool(found_inf):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the unscaled gradients is non-finite, so it cannot "
            "be clipped. HINT: leave error_if_nonfinite=False under a loss scaler: an overflowing step "
            "is skipped and the scale backs off."
        )
    coef = clip_coefficient(total_norm, max_norm)
    if fold:
        divisor = torch.ones_like(coef) if grad_scale is None else grad_scale.to(coef)
        return ClipResult(total_norm, found_inf, divisor / coef)
    kernels.mul_(grads, coef if grad_scale is None else coef / grad_scale.to(coef))
    return ClipResult(total_norm, found_inf, None)
