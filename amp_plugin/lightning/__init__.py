"""The Lightning adapters: the only part of amp_plugin that imports ``lightning``.

Import :class:`~amp_plugin.AMPPrecision`, :class:`~amp_plugin.AMPFSDPPrecision` and
:class:`~amp_plugin.LossScaleMonitor` from ``amp_plugin`` (which loads their modules here on first
use), Fabric's plugin as ``amp_plugin.lightning.fabric.AMPPrecision``, and :data:`CHECKPOINT_KEY`
from here: the key under which a Trainer checkpoint holds the plugin's state.
"""

from __future__ import annotations

from amp_plugin.lightning._checkpoint import CHECKPOINT_KEY

__all__ = ["CHECKPOINT_KEY"]
