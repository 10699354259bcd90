"""Re-exports :class:`~amp_plugin.lightning.AMPPrecision` and ``CHECKPOINT_KEY`` from their home.

The adapter lives in :mod:`amp_plugin.lightning.plugin`; this path keeps working.
"""

from __future__ import annotations

from amp_plugin.lightning import CHECKPOINT_KEY, AMPPrecision

__all__ = ["CHECKPOINT_KEY", "AMPPrecision"]
