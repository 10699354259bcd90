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
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from amp_plugin import _scaler_rules
from amp_plugin._iteration import Iteration, OptimizerState, Stage
from amp_plugin._validation import check_bool, check_number, fail
from amp_plugin.distributed import GlobalNormKernels
from amp_plugin.kernels import Kernels
from amp_plugin.optim import gradients_to_unscale, handles_unscaling, unwrap_optimizer
from amp_plugin.sharding import has_dtensor

if TYPE_CHECKING:
    from amp_plugin.scale_policy import DynamicScale

__all__ = ["ClipResult", "UnscaledClipping", "clip_coefficient", "clip_grad_norm_", "gradients"]

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
                    "amp_plugin does not unscale or clip sparse gradients (a parameter of shape "
                    f"{tuple(param.shape)} has a sparse .grad). HINT: use a dense embedding "
                    "(sparse=False) or torch.amp.GradScaler for this model."
                )
            grads.append(grad)
    return grads


def nonfinite(kernels: Kernels, grads: Sequence[Tensor]) -> Tensor:
    """``1.0`` where a gradient element is inf/NaN, else ``0.0`` (fp32, 0-dim): one read, no write.

    The fp32 total norm is non-finite exactly when an element is (or when the norm itself
    overflows fp32, above about 1.8e19, which counts as an overflow too).

    Example:
        >>> from amp_plugin.kernels import get_kernels
        >>> nonfinite(get_kernels("torch"), [torch.tensor([1.0, float("inf")])])
        tensor(1.)
    """
    norm = kernels.norm(grads)
    return torch.isfinite(norm).logical_not_().float()


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as in ``torch.nn.utils.clip_grad_norm_``.

    Example:
        >>> clip_coefficient(torch.tensor(4.0), 1.0), clip_coefficient(torch.tensor(0.5), 1.0)
        (tensor(0.2500), tensor(1.))
    """
    return torch.clamp(max_norm / (total_norm + _EPS), max=1.0)


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
    # Gradients already unscaled take torch's own recipe, so that the result is bit-identical to
    # unscale_ + torch.nn.utils.clip_grad_norm_; scaled ones take the backend's fastest norm.
    norm_in_memory = kernels.norm(grads, norm_type, exact=grad_scale is None)
    total_norm = norm_in_memory if grad_scale is None else norm_in_memory / grad_scale.to(norm_in_memory)
    # Non-finite when a gradient is inf/NaN, and also when unscaling by a scale below 1 overflows.
    found_inf = (~torch.isfinite(total_norm)).float()
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
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


class UnscaledClipping:
    """``LossScaler``'s methods on the unscaled gradients (clip, norm, re-check), whatever their state.

    Mixed into :class:`~amp_plugin.LossScaler`, whose per-optimizer state tells whether the
    gradients in memory still carry the scale (or a folded clip factor). Not used alone.

    Example:
        >>> from amp_plugin import LossScaler
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler("cpu", init_scale=1024.0)
        >>> scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
        >>> grad_before = model.weight.grad.clone()  # [3, 4] times the scale
        >>> round(scaler.clip_grad_norm_(opt, max_norm=1.0).item(), 4)  # the unscaled norm
        5.0
        >>> [round(g, 4) for g in model.weight.grad.flatten().tolist()]  # unscaled and clipped
        [0.6, 0.8]
    """

    _enabled: bool
    _guard_only: bool
    process_group: Any
    _iteration: Iteration
    _policy: DynamicScale

    def _backend(self) -> Kernels:
        raise NotImplementedError

    def _require_scale(self, call: str) -> Tensor:
        raise NotImplementedError

    def _state(self, opt: Any, call: str) -> OptimizerState:
        raise NotImplementedError

    def unscale_(self, optimizer: Any) -> None:
        raise NotImplementedError

    def clip_grad_norm_(
        self,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        sharded: bool = False,
    ) -> Tensor:
        """Clip the optimizer's gradients by their unscaled total norm; return that norm.

        Before ``unscale_`` the norm and the inf check come from one read of the scaled
        gradients, then one multiply applies ``clip_coef / scale`` (for a fused optimizer
        the factor goes into its ``grad_scale`` instead). Equal to ``unscale_`` followed by
        ``torch.nn.utils.clip_grad_norm_`` up to fp32 rounding. A non-finite norm marks the
        step as overflowing, also after an explicit ``unscale_``. With ``sharded=True`` the
        optimizer holds only this rank's shard of the gradients, and the norm is that of
        all shards across ``process_group`` (one extra collective of one element).
        ``DTensor`` gradients (``fully_shard``) need no flag: their norm is always global.
        """
        call = "LossScaler.clip_grad_norm_"
        max_norm = check_number(call, "max_norm", max_norm, low=0.0, hint="e.g. max_norm=1.0.")
        norm_type = _scaler_rules.check_norm_type(call, norm_type)
        error_if_nonfinite = check_bool(call, "error_if_nonfinite", error_if_nonfinite)
        sharded = check_bool(call, "sharded", sharded)
        opt = unwrap_optimizer(optimizer)
        grads = gradients(opt.param_groups)
        if sharded and has_dtensor(grads):
            fail(call, "sharded=True", "sharded=False when the gradients are DTensors (fully_shard)",
                 "DTensor gradients carry their sharding and their norm is already global; "
                 "sharded=True is for plain tensors that hold one rank's shard (FSDP1, ZeRO).")  # fmt: skip
        kernels = GlobalNormKernels(self._backend(), self.process_group) if sharded else None
        if not self._enabled:
            return clip_grad_norm_(kernels or self._backend(), grads, max_norm, norm_type).total_norm
        state = self._clippable_state(opt, call)
        ready = state.stage is Stage.READY
        carried = self._carried_factor(opt) if ready else state.grad_scale
        # Fold only while the gradients still carry a factor: once unscaled in memory, the
        # in-place multiply is torch's own recipe, bit for bit.
        fold = carried is not None and handles_unscaling(opt)
        result = clip_grad_norm_(
            kernels or self._backend(), grads, max_norm, norm_type,
            grad_scale=carried, fold=fold, error_if_nonfinite=error_if_nonfinite,
        )  # fmt: skip
        state.merge_inf(result.found_inf, agreed=sharded)  # a global norm is agreed already
        state.stage, state.grad_scale = Stage.UNSCALED, result.grad_scale
        return result.total_norm

    def grad_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The total norm of the optimizer's unscaled gradients, leaving them as they are (one read)."""
        norm_type = _scaler_rules.check_norm_type("LossScaler.grad_norm", norm_type)
        opt = unwrap_optimizer(optimizer)
        norm = self._backend().norm(gradients(opt.param_groups), norm_type)
        state = self._iteration.get(id(opt))
        if not self._enabled or self._policy.scale is None:
            return norm
        carried = (
            self._carried_factor(opt) if state is None or state.stage is Stage.READY else state.grad_scale
        )
        return norm if carried is None else norm / carried.to(norm)

    def clip_grad_value_(self, optimizer: Any, clip_value: float) -> None:
        """Clamp every unscaled gradient element to ``[-clip_value, clip_value]``."""
        clip_value = check_number("LossScaler.clip_grad_value_", "clip_value", clip_value, low=0.0,
                                  hint="e.g. clip_value=0.5.")  # fmt: skip
        opt = unwrap_optimizer(optimizer)
        grads = gradients(opt.param_groups)
        if self._enabled:
            state = self._clippable_state(opt, "LossScaler.clip_grad_value_")
            if state.stage is Stage.READY:
                self.unscale_(opt)
            elif state.grad_scale is not None:  # a folded norm clip: materialise it first
                self._backend().mul_(grads, state.grad_scale.reciprocal())
                state.grad_scale = None
        torch.nn.utils.clip_grad_value_(
            [p for g in opt.param_groups for p in g["params"] if p.grad is not None], clip_value
        )

    def _clippable_state(self, opt: Any, call: str) -> OptimizerState:
        state = self._state(opt, call)
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                f"{call}() was called after step() on this optimizer. HINT: clip before step()."
            )
        return state

    def _carried_factor(self, opt: Any) -> Tensor | None:
        """What still-scaled gradients carry: the scale, times a fused optimizer's preset ``grad_scale``.

        ``None`` for a guard (a static scale of 1) without a preset: nothing to divide by.
        """
        scale = self._require_scale("clip")
        if self._guard_only:
            return getattr(opt, "grad_scale", None) if handles_unscaling(opt) else None
        preset = getattr(opt, "grad_scale", None) if handles_unscaling(opt) else None
        return scale if preset is None else scale * preset

    def recheck_(self, optimizer: Any) -> None:
        """Mark the step as overflowing if an unscaled gradient of ``optimizer`` is now inf/NaN.

        For changes made after ``unscale_`` or a clip (hooks, penalties): one read of the
        gradients (their norm), no write. Before ``unscale_`` there is nothing to do (``step``
        checks the gradients then). The flag is agreed across ranks again before the step.
        """
        if not self._enabled:
            return
        opt = unwrap_optimizer(optimizer)
        state = self._iteration.get(id(opt))
        if state is None or state.stage is Stage.READY:
            return
        if state.stage is Stage.STEPPED or state.found_inf is None:
            raise RuntimeError(
                "recheck_() was called after step() on this optimizer. HINT: recheck before step()."
            )
        state.merge_inf(nonfinite(self._backend(), gradients_to_unscale(opt)), agreed=False)
