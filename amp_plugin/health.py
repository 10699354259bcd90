"""The run-health classifier behind ``LossScaleMonitor``; kept importable under its first name.

It lives in :mod:`amp_plugin.diagnostics.health` (``SkipHealth``),
:mod:`amp_plugin.diagnostics.health_state` (``ScaleRecord`` and the checkpoint checks) and
:mod:`amp_plugin.diagnostics.health_plot` (``plot_history``).
"""

from __future__ import annotations

from amp_plugin.diagnostics.health import (
    SHOWN_FLAGS,
    HealthVerdict,
    SkipHealth,
    validate_monitor_options,
    validate_policy,
)
from amp_plugin.diagnostics.health_plot import plot_history
from amp_plugin.diagnostics.health_state import (
    HealthState,
    ScaleRecord,
    check_health_state,
    check_monitor_state,
    check_records,
)

__all__ = [
    "SHOWN_FLAGS",
    "HealthState",
    "HealthVerdict",
    "ScaleRecord",
    "SkipHealth",
    "check_health_state",
    "check_monitor_state",
    "check_records",
    "plot_history",
    "validate_monitor_options",
    "validate_policy",
]
