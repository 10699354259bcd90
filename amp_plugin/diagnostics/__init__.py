"""Find where inf/NaN come from, check an optimizer set-up at fit start, audit a model for fp16.

Import every name from here (the modules behind them are private):

* :func:`nonfinite_gradients` names the parameters whose gradient holds inf/NaN, for a skipped step.
* :class:`NonFiniteTracer` hooks every submodule while attached and records the first one, in
  execution order, whose output or gradient went non-finite.
* :func:`check_optimizer_setup` turns torch's late errors ("Attempting to unscale FP16
  gradients", "No inf checks were recorded") into findings at fit start.
* :func:`audit_model` finds fp16 hazards in a model; :func:`device_report` (and
  :func:`format_device_report`) says what this machine supports and which precision to use;
  :func:`probe_autocast_ops` (and :func:`format_autocast_ops`) runs common ops under autocast and
  records the dtype each returns; :func:`fp8_report` measures each Linear layer's fp8 error.
  Together they back ``python -m amp_plugin doctor``.

Plain torch: nothing here imports Lightning; nothing costs anything until it is called.
"""

from __future__ import annotations

from amp_plugin.diagnostics._audit import audit_model
from amp_plugin.diagnostics._autocast_ops import format_autocast_ops, probe_autocast_ops
from amp_plugin.diagnostics._device_report import device_report, format_device_report
from amp_plugin.diagnostics._fp8_report import fp8_report
from amp_plugin.diagnostics._nonfinite import nonfinite_gradients
from amp_plugin.diagnostics._optimizer_check import check_optimizer_setup
from amp_plugin.diagnostics._tracer import NonFiniteTracer

__all__ = [
    "NonFiniteTracer",
    "audit_model",
    "check_optimizer_setup",
    "device_report",
    "format_autocast_ops",
    "format_device_report",
    "fp8_report",
    "nonfinite_gradients",
    "probe_autocast_ops",
]
