"""``AMPPrecision``'s gradient clipping and gradient-norm hooks, by norm or by value, scaled or not.

With a loss scaler the scaler clips (it unscales first and marks a step whose norm is inf/NaN
as overflowing); without one, :mod:`amp_plugin.clipping` does, on the chosen kernels. Either way
the norm before clipping is kept as ``last_grad_norm`` for ``LossScaleMonitor``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer

from amp_plugin import clipping
from amp_plugin.kernels import Backend, Kernels, get_kernels
from amp_plugin.optim import unwrap_optimizer
from amp_plugin.scaler import LossScaler
from amp_plugin.sharding import ShardAwareKernels

__all__ = ["ClippingHooks"]


class ClippingHooks:
    """``AMPPrecision``'s clipping hooks and ``request_grad_norm``.

    A mixin placed before Lightning's ``MixedPrecision``; it reads the plugin's ``scaler`` and
    ``kernels`` and keeps ``last_grad_norm`` and the flags the optimizer step reads.

    Example:
        >>> from amp_plugin.lightning import AMPPrecision
        >>> issubclass(AMPPrecision, ClippingHooks)
        True
    """

    scaler: LossScaler | None
    kernels: Backend
    last_grad_norm: Tensor | None
    _want_grad_norm: bool
    _norm_clipped: bool
    _no_clip: bool

    def request_grad_norm(self) -> None:
        """Have the next optimizer step record ``last_grad_norm`` even without clipping.

        With clipping on, the norm comes free with the clip; otherwise it costs one read of the
        gradients, which is why it is asked for per step (e.g. on logging steps only).
        """
        self._want_grad_norm = True

    def _grad_norm(self, optimizer: Any) -> Tensor:
        if self.scaler is not None:
            return self.scaler.grad_norm(optimizer)
        grads = clipping.gradients(unwrap_optimizer(optimizer).param_groups)
        return self._kernels_for(grads).norm(grads)

    def _kernels_for(self, grads: list[Tensor]) -> Kernels:
        return ShardAwareKernels(get_kernels(self.kernels, grads[0].device if grads else None))

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0 or self._no_clip:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._norm_clipped = True
        if self.scaler is not None:
            self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, float(clip_val))
            return
        grads = clipping.gradients(unwrap_optimizer(optimizer).param_groups)
        self.last_grad_norm = clipping.clip_grad_norm_(
            self._kernels_for(grads), grads, float(clip_val)
        ).total_norm

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._want_grad_norm and self.last_grad_norm is None:  # the norm before clipping
            self.last_grad_norm = self._grad_norm(optimizer)
        if self.scaler is not None:
            self.scaler.clip_grad_value_(optimizer, float(clip_val))
        else:
            Precision.clip_grad_by_value(self, unwrap_optimizer(optimizer), clip_val)  # type: ignore[arg-type]  # mixed into a Precision
