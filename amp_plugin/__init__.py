"""amp_plugin: automatic mixed precision for PyTorch Lightning that long runs can trust.

``import amp_plugin`` imports neither Lightning nor Apex and does not initialise CUDA.
The Lightning pieces (:class:`AMPPrecision`, :class:`AMPFSDPPrecision`,
:class:`LossScaleMonitor`, at home in :mod:`amp_plugin.lightning`) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from amp_plugin._run import RunOptions
from amp_plugin._scale_policy import ScaleFloorWarning, SkipStreakWarning
from amp_plugin._scaler import LossScaler
from amp_plugin.autocast import AutocastDataParallel, autocast_state, propagate_autocast
from amp_plugin.kernels import get_kernels

if TYPE_CHECKING:
    from amp_plugin.lightning._fsdp import AMPFSDPPrecision
    from amp_plugin.lightning._monitor import LossScaleMonitor
    from amp_plugin.lightning._plugin import AMPPrecision

__version__ = "0.1.0"

__all__ = [
    "AMPFSDPPrecision",
    "AMPPrecision",
    "AutocastDataParallel",
    "LossScaleMonitor",
    "LossScaler",
    "RunOptions",
    "ScaleFloorWarning",
    "SkipStreakWarning",
    "autocast_state",
    "get_kernels",
    "propagate_autocast",
]

_LAZY = {
    "AMPFSDPPrecision": "amp_plugin.lightning._fsdp",
    "AMPPrecision": "amp_plugin.lightning._plugin",
    "LossScaleMonitor": "amp_plugin.lightning._monitor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'amp_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy ones, so that ``dir()`` and tab completion show every public name."""
    return sorted(set(globals()) | set(__all__))
