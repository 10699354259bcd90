"""The values ``LossScaleMonitor`` reports: built once, sent to the loggers and to ``callback_metrics``.

Kept apart from :mod:`amp_plugin.lightning._monitor` so that the callback reads as hooks. The
numbers arrive here as Python values the monitor has already read from the device, so
publishing them costs no host sync.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import GradClipAlgorithmType

from amp_plugin import _clipping as clipping
from amp_plugin._scaler import LossScaler

__all__ = ["amp_metrics", "publish"]


def amp_metrics(
    scaler: LossScaler | None,
    scale: float,
    skipped: int,
    skip_rate: float,
    grad_norm: float,
    clip: tuple[GradClipAlgorithmType, float] | None,
) -> dict[str, float]:
    """The ``amp/*`` metrics of one step; ``nan`` means not known (that key is left out).

    Example:
        >>> amp_metrics(None, math.nan, 0, 0.0, 2.0, (GradClipAlgorithmType.NORM, 1.0))
        {'amp/skipped_steps': 0.0, 'amp/skip_rate': 0.0, 'amp/grad_norm': 2.0,
         'amp/grad_norm_clipped': 0.99999...}
    """
    metrics: dict[str, float] = {}
    if scaler is not None:
        metrics["amp/scale"] = scale
    metrics["amp/skipped_steps"] = float(skipped)
    metrics["amp/skip_rate"] = skip_rate
    if not math.isnan(grad_norm):
        metrics["amp/grad_norm"] = grad_norm
        if clip is not None and clip[0] == GradClipAlgorithmType.NORM:
            # The clip multiplies by min(1, clip_val / (norm + 1e-6)): its result's norm, with no pass.
            coef = clipping.clip_coefficient(torch.tensor(grad_norm), clip[1])
            metrics["amp/grad_norm_clipped"] = grad_norm * float(coef)
    return metrics


def publish(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Put ``metrics`` into ``trainer.callback_metrics`` as float64 CPU tensors (exactly the logged floats).

    ``EarlyStopping`` and ``ModelCheckpoint`` read their ``monitor`` key there. Lightning keeps
    that dict for the whole fit (it is cleared when a run starts), so a value stays until the
    next publication.

    Example:
        >>> trainer = Trainer(accelerator="cpu", logger=False)
        >>> publish(trainer, {"amp/skip_rate": 0.25})
        >>> trainer.callback_metrics["amp/skip_rate"]
        tensor(0.2500, dtype=torch.float64)
    """
    trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()})
