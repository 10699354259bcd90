"""The Lightning adapters: the only part of amp_plugin that imports ``lightning``.

``from amp_plugin import AMPPrecision, LossScaleMonitor`` is the usual import (it loads this
package on first use); ``amp_plugin.plugin`` and ``amp_plugin.callbacks`` still re-export them.

- :class:`AMPPrecision` (``plugin.py``): the precision plugin, a Lightning ``MixedPrecision``.
- :class:`AMPFSDPPrecision` (``fsdp.py``): Lightning's ``FSDPPrecision`` with a ``LossScaler``.
- :class:`LossScaleMonitor` (``monitor.py``): the callback that logs and judges the loss scaler.
- :data:`CHECKPOINT_KEY` (``checkpoint.py``): where the scaler state sits in a checkpoint.
- Fabric's ``AMPPrecision`` (``fabric.py``): imported as ``amp_plugin.fabric.AMPPrecision``, not
  from here, so that the Trainer's plugin keeps the short name.
"""

from __future__ import annotations

from amp_plugin.lightning.checkpoint import CHECKPOINT_KEY
from amp_plugin.lightning.fsdp import AMPFSDPPrecision
from amp_plugin.lightning.monitor import LossScaleMonitor
from amp_plugin.lightning.plugin import AMPPrecision

__all__ = ["CHECKPOINT_KEY", "AMPFSDPPrecision", "AMPPrecision", "LossScaleMonitor"]
