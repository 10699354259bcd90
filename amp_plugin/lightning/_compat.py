"""Every read of a private Lightning name, in one place.

Each function below reads one Lightning internal; ``test_lightning_internals_we_read_still_exist``
in ``tests/integration/test_plugin_lightning.py`` pins every entry of ``__all__``, so a Lightning
upgrade that renames one fails there rather than in a user's run. Also relied upon:

- ``Precision._after_closure`` (read through :func:`after_closure`) is the order Lightning runs
  between the closure and the step; ``AMPFSDPPrecision`` inherits it from ``FSDPPrecision``.
- Lightning files a precision plugin's non-empty ``state_dict`` under the class's ``__qualname__``
  (``"MixedPrecision"`` for its own; the pre-2.0 key was ``"native_amp_scaling_state"``), which is
  where :mod:`amp_plugin.lightning._checkpoint` looks for a foreign scaler state. Lightning also loads
  ``checkpoint["native_amp_scaling_state"]`` into any MixedPrecision after ``on_load_checkpoint``
  has loaded it: the same state twice, which changes nothing.
- ``Trainer.callback_metrics`` returns the logger connector's own dict, kept for the whole fit
  (cleared when a run starts), so a callback's entries written into it stay there until
  overwritten; ``EarlyStopping`` and ``ModelCheckpoint`` read their ``monitor`` key from it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from torch import Tensor

__all__ = [
    "after_closure",
    "attached_trainer",
    "before_backward_hooks",
    "called_by_fabric",
    "epoch_training_done",
    "init_fsdp_precision",
    "logged_step",
    "set_fabric_input_dtype",
    "should_update_logs",
]


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The Trainer ``module`` is attached to, or ``None``: reads ``LightningModule._trainer``.

    The public ``module.trainer`` raises while no Trainer is attached.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> attached_trainer(BoringModel()) is None
        True
    """
    return module._trainer


def after_closure(precision: Precision, model: LightningModule, optimizer: Any) -> None:
    """Run the plugin's ``_after_closure`` (Lightning's): ``on_before_optimizer_step`` hooks, then clipping.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Model(BoringModel):
        ...     def on_before_optimizer_step(self, optimizer):
        ...         print("on_before_optimizer_step")
        >>> model = Model()
        >>> trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(model)
        on_before_optimizer_step
        >>> after_closure(trainer.precision_plugin, model, trainer.optimizers[0])
        on_before_optimizer_step
    """
    precision._after_closure(model, optimizer)


def before_backward_hooks(precision: Precision, loss: Tensor, module: LightningModule) -> None:
    """Run the ``on_before_backward`` hooks (callbacks, then the module) with the unscaled ``loss``.

    Lightning's base ``Precision.pre_backward``, which calls its private ``call._call_*_hook``
    helpers; ``MixedPrecision.pre_backward`` would also scale the loss with its GradScaler.
    """
    Precision.pre_backward(precision, loss, module)


def called_by_fabric() -> bool:
    """Whether the caller's caller is Lightning Fabric's own code (``Fabric.setup`` and the like).

    Reads the calling frame's module name (``lightning.fabric...`` or ``lightning_fabric...``): a
    Trainer precision plugin handed to ``Fabric(plugins=...)`` can refuse at ``setup`` while a
    direct call (a test, a script) still works.

    Example:
        >>> called_by_fabric()
        False
    """
    name = str(sys._getframe(2).f_globals.get("__name__", ""))
    return name.startswith(("lightning.fabric", "lightning_fabric"))


def set_fabric_input_dtype(plugin: Any, dtype: torch.dtype) -> None:
    """Set what Fabric's ``MixedPrecision.__init__`` sets as ``_desired_input_dtype``.

    Fabric's throughput utilities (``_plugin_to_compute_dtype``, behind ``ThroughputMonitor``'s
    FLOPs) read it from any ``MixedPrecision``; ``amp_plugin.lightning.fabric.AMPPrecision`` does not run
    that ``__init__`` (it takes only the "-mixed" strings and builds a torch GradScaler).

    Example:
        >>> from lightning.fabric.plugins import MixedPrecision
        >>> plugin = MixedPrecision("bf16-mixed", "cpu")
        >>> set_fabric_input_dtype(plugin, torch.float16)
        >>> plugin._desired_input_dtype
        torch.float16
    """
    plugin._desired_input_dtype = dtype


def should_update_logs(trainer: Trainer) -> bool:
    """Whether Lightning logs the current batch (``log_every_n_steps``).

    Reads ``trainer._logger_connector.should_update_logs``, the predicate Lightning's own
    LearningRateMonitor and DeviceStatsMonitor read.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> should_update_logs(Trainer(accelerator="cpu", log_every_n_steps=0, logger=False))
        False
    """
    return bool(trainer._logger_connector.should_update_logs)


def logged_step(trainer: Trainer) -> int:
    """The step under which Lightning files the current batch's metrics.

    Reads ``trainer.fit_loop.epoch_loop._batches_that_stepped``, as Lightning's LearningRateMonitor does.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> logged_step(Trainer(accelerator="cpu", logger=False))
        0
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def epoch_training_done(trainer: Trainer) -> bool:
    """Whether the current batch is the epoch's last training batch (or ``max_steps`` is reached).

    Reads ``trainer.fit_loop.epoch_loop._is_training_done``; true in ``on_train_batch_end`` of the
    batch after which the epoch's validation (if any) and ``on_train_epoch_end`` come.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> epoch_training_done(Trainer(accelerator="cpu", logger=False, max_steps=0))
        True
    """
    return bool(trainer.fit_loop.epoch_loop._is_training_done)


def init_fsdp_precision(plugin: FSDPPrecision, precision: str, scaler: Any) -> None:
    """Run ``FSDPPrecision.__init__`` on ``plugin`` and keep ``scaler`` (a ``LossScaler`` or ``None``).

    Lightning 2.6's ``FSDPPrecision.__init__`` checks ``self.precision`` (still the class
    default, ``"32-true"``) before it sets it, so it refuses any scaler, and it then stores
    ``None`` (or a new ``ShardedGradScaler``) instead of the scaler passed. The precision is set
    first, so the check sees the real one and no ``ShardedGradScaler`` is built; the scaler after.

    Example:
        >>> plugin = FSDPPrecision.__new__(FSDPPrecision)
        >>> init_fsdp_precision(plugin, "16-mixed", "my scaler")
        >>> plugin.precision, plugin.scaler
        ('16-mixed', 'my scaler')
    """
    plugin.precision = precision  # type: ignore[assignment]
    FSDPPrecision.__init__(plugin, precision, scaler=scaler)  # type: ignore[arg-type]
    plugin.scaler = scaler
