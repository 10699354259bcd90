"""The Lightning adapters: the only part of amp_plugin that imports ``lightning``.

Import :class:`AMPPrecision`, :class:`AMPFSDPPrecision` and :class:`LossScaleMonitor` from
``amp_plugin`` (which loads this package on first use); :data:`CHECKPOINT_KEY` from here.

- :class:`AMPPrecision` (``plugin.py``): the precision plugin, a Lightning ``MixedPrecision``.
- :class:`AMPFSDPPrecision` (``fsdp.py``): Lightning's ``FSDPPrecision`` with a ``LossScaler``.
- :class:`LossScaleMonitor` (``monitor.py``): the callback that logs and judges the loss scaler.
- :data:`CHECKPOINT_KEY` (``checkpoint.py``): where the scaler state sits in a checkpoint.
- Fabric's ``AMPPrecision`` (``fabric.py``): imported as ``amp_plugin.fabric.AMPPrecision``, not
  from here, so that the Trainer's plugin keeps the short name.
"""

from __future__ import annotations

from amp_plugin.lightning._checkpoint import CHECKPOINT_KEY
from amp_plugin.lightning._fsdp import AMPFSDPPrecision
from amp_plugin.lightning._monitor import LossScaleMonitor
from amp_plugin.lightning._plugin import AMPPrecision

__all__ = ["CHECKPOINT_KEY", "AMPFSDPPrecision", "AMPPrecision", "LossScaleMonitor"]
