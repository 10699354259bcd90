"""Where ``LossScaleMonitor``'s values go besides the loggers: ``trainer.callback_metrics``.

Kept apart from :mod:`amp_plugin.lightning._monitor` so that the callback reads as hooks. The
values are built by :func:`amp_plugin._metrics.amp_metrics` from numbers the monitor has already
read from the device, so publishing them costs no host sync.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

__all__ = ["publish"]


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
