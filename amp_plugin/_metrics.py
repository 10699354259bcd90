"""The ``amp/*`` values of a step, as every adapter reports them (the Trainer's monitor, Fabric's plugin).

Plain Python numbers in, a dict of floats out: the values arrive already read from the device, so
building them costs no host sync.
"""

from __future__ import annotations

import math

import torch

from amp_plugin import _clipping as clipping
from amp_plugin._scaler import LossScaler

__all__ = ["amp_metrics"]


def amp_metrics(
    scaler: LossScaler | None,
    scale: float,
    skipped: int,
    skip_rate: float,
    grad_norm: float | None,
    clip: tuple[str, float] | None = None,
) -> dict[str, float]:
    """The ``amp/*`` metrics of one step; a ``grad_norm`` of ``None`` is not known (its keys are left out).

    A NaN norm (a step with a NaN gradient) is logged as NaN, as an inf one is logged as inf.

    ``amp/scale`` where a loss ``scaler`` runs, ``amp/skipped_steps``, ``amp/skip_rate``,
    ``amp/grad_norm`` (the unscaled norm before clipping) and, under a norm ``clip`` (``("norm",
    max_norm)``), ``amp/grad_norm_clipped``: the norm the clip left, computed from its factor.

    Example:
        >>> amp_metrics(None, math.nan, 0, 0.0, 2.0, ("norm", 1.0))
        {'amp/skipped_steps': 0.0, 'amp/skip_rate': 0.0, 'amp/grad_norm': 2.0,
         'amp/grad_norm_clipped': 0.99999...}
    """
    metrics: dict[str, float] = {}
    if scaler is not None:
        metrics["amp/scale"] = scale
    metrics["amp/skipped_steps"] = float(skipped)
    metrics["amp/skip_rate"] = skip_rate
    if grad_norm is not None:
        metrics["amp/grad_norm"] = grad_norm
        if clip is not None and clip[0] == "norm":
            # The clip multiplies by min(1, clip_val / (norm + 1e-6)): its result's norm, with no pass.
            coef = clipping.clip_coefficient(torch.tensor(grad_norm), clip[1])
            # A non-finite norm's step is skipped: nothing was clipped, and there is no clipped norm.
            clipped = grad_norm * float(coef) if math.isfinite(grad_norm) else math.nan
            metrics["amp/grad_norm_clipped"] = clipped
    return metrics
