"""Find where inf/NaN come from, check an optimizer set-up at fit start, audit a model for fp16.

One public module per idea; their main names are importable from here too:

* :mod:`~amp_plugin.diagnostics._nonfinite`: :func:`nonfinite_gradients` names the parameters
  whose gradient holds inf/NaN, for a skipped step.
* :mod:`~amp_plugin.diagnostics._tracer`: :class:`NonFiniteTracer` hooks every submodule while
  attached and records the first one, in execution order, whose output or gradient went non-finite.
* :mod:`~amp_plugin.diagnostics._optimizer_check`: :func:`check_optimizer_setup` turns torch's late
  errors ("Attempting to unscale FP16 gradients", "No inf checks were recorded") into findings
  at fit start.
* :mod:`~amp_plugin.diagnostics._audit`: :func:`audit_model` finds fp16 hazards in a model;
  :mod:`~amp_plugin.diagnostics._device_report`: :func:`device_report` says what this machine
  supports and which precision to use; :mod:`~amp_plugin.diagnostics._autocast_ops`:
  :func:`probe_autocast_ops` runs common ops under autocast and records the dtype each returns.
  Together they back ``python -m amp_plugin doctor``.
* :mod:`~amp_plugin.diagnostics._host_reads`: :class:`~amp_plugin.diagnostics._host_reads.HostReads`
  counts the reads of tensor values back to the host (each one a device sync on a GPU).
* :mod:`~amp_plugin.diagnostics._health`: :class:`~amp_plugin.diagnostics._health.SkipHealth`
  classifies a run's skipped steps (behind ``LossScaleMonitor``).

Plain torch: nothing here imports Lightning; nothing costs anything until it is called.
"""

from __future__ import annotations

from amp_plugin.diagnostics._audit import AuditReport, Finding, audit_model
from amp_plugin.diagnostics._autocast_ops import AutocastOps, OpProbe, format_autocast_ops, probe_autocast_ops
from amp_plugin.diagnostics._device_report import device_report, format_device_report
from amp_plugin.diagnostics._nonfinite import NonFiniteGradient, nonfinite_gradients
from amp_plugin.diagnostics._optimizer_check import check_optimizer_setup
from amp_plugin.diagnostics._tracer import NonFiniteRecord, NonFiniteTracer

__all__ = [
    "AuditReport",
    "AutocastOps",
    "Finding",
    "NonFiniteGradient",
    "NonFiniteRecord",
    "NonFiniteTracer",
    "OpProbe",
    "audit_model",
    "check_optimizer_setup",
    "device_report",
    "format_autocast_ops",
    "format_device_report",
    "nonfinite_gradients",
    "probe_autocast_ops",
]
