"""Re-exports :class:`~amp_plugin.lightning.LossScaleMonitor` from its home.

The callback lives in :mod:`amp_plugin.lightning.monitor`; this path keeps working.
"""

from __future__ import annotations

from amp_plugin.lightning import LossScaleMonitor

__all__ = ["LossScaleMonitor"]
