"""``LossScaleMonitor``: what the loss scaler does, in the Trainer's logger and in words.

Cost model (see ``docs/monitoring.md``): per optimizer step the monitor takes the step's skip
flag as the plugin already holds it (``AMPPrecision.driver.last_skip``): a bool where a non-fused step
read it, so no read here; a fused step's device flag is kept and read, with the others since,
in one host read at the next logged step (or the epoch's end). The scale, the skip count and the gradient
norm are read only on steps that Lightning logs (``Trainer(log_every_n_steps=...)``) and on
skipped steps. The gradient norm is the one the clip computed; without clipping it is asked for
on logged steps only (``AMPPrecision.request_grad_norm``). The monitor overrides neither
``on_before_optimizer_step`` nor ``configure_gradient_clipping``, so the plugin keeps its
fast clipping path. Forensics and tracing run only when asked for or when a step was skipped.
The same values go into ``trainer.callback_metrics`` on logged steps and, when the step was
not logged, at the end of each epoch's training and before each validation (the scale and
skip count read there: a few syncs once per epoch or validation, none on other steps).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from amp_plugin import diagnostics
from amp_plugin._metrics import amp_metrics
from amp_plugin._scaler import LossScaler
from amp_plugin._step import read_flags
from amp_plugin.diagnostics._health import (
    SHOWN_FLAGS,
    HealthVerdict,
    SkipHealth,
    validate_monitor_options,
    validate_policy,
)
from amp_plugin.diagnostics._health_plot import plot_history
from amp_plugin.diagnostics._health_state import HealthState, ScaleRecord, check_monitor_state
from amp_plugin.lightning import _compat
from amp_plugin.lightning._fsdp import AMPFSDPPrecision
from amp_plugin.lightning._monitor_values import publish
from amp_plugin.lightning._plugin import AMPPrecision

__all__ = ["LossScaleMonitor"]

_Plugin = AMPPrecision | AMPFSDPPrecision  # what the monitor reads: the Trainer's plugin, or FSDPStrategy's

_MAX_RECORDS = 10_000  # history kept for the plot and the checkpoint; halved (every other row) when full


class LossScaleMonitor(Callback):
    """Log the loss scale, skipped steps and gradient norm; judge the run's health; find inf/NaN.

    Logged through every logger the Trainer has, on the steps Lightning logs
    (``log_every_n_steps``): ``amp/scale`` (fp16 only), ``amp/skipped_steps``, ``amp/skip_rate``
    (over the last ``window`` steps), ``amp/grad_norm`` (unscaled, before clipping) and, with
    norm clipping (``gradient_clip_val``, not by value), ``amp/grad_norm_clipped``. With
    ``AMPPrecision(fp8=...)``, once at the start of fit: ``amp/fp8_layers`` (Linear layers in fp8)
    and ``amp/fp8_param_share`` (their share of all Linear parameters). The same values are in
    ``trainer.callback_metrics`` on every rank (as float64 tensors), refreshed also at each
    epoch's end and before each validation, so ``EarlyStopping(monitor="amp/skip_rate")`` and
    ``ModelCheckpoint(monitor="amp/scale", mode="max")`` work. Health changes (see
    :class:`SkipHealth`) are said once each; a pathological one warns or, with
    ``on_pathological="raise"``, stops training with a ``RuntimeError`` carrying the recent
    history. On the first skipped step and on each turn to pathological the monitor names the
    parameters whose gradient is inf/NaN; ``trace_nonfinite=True`` also names the first module,
    in execution order, whose output or gradient went non-finite (forward/backward hooks, only
    while training). Needs ``Trainer(plugins=[AMPPrecision(...)])``, or under Lightning's
    ``FSDPStrategy`` its ``precision_plugin=AMPFSDPPrecision(...)``.

    Args:
        warmup_steps: first steps whose skips are calibration, not a problem (fp16's loss scale;
            without one, as under bf16, there is no warm-up).
        window: recent steps covered by ``amp/skip_rate`` and the skip-rate rule.
        max_consecutive_skips: skipped steps in a row (after warm-up) that are pathological.
        max_skip_rate: skip rate over a window above which the run is pathological.
        on_pathological: ``"warn"`` (default) or ``"raise"``.
        trace_nonfinite: hook every submodule to name where inf/NaN first appear (costly).
        plot_path: write a PNG of the scale and skipped steps there at the end of fit, and say
            where (needs matplotlib); ``(step, label)`` pairs appended to ``monitor.plot_events``
            (an injected fault) are marked on it.

    Example:
        >>> monitor = LossScaleMonitor(max_consecutive_skips=5, on_pathological="raise")
        >>> monitor.health, monitor.summary()
        ('clean', 'LossScaleMonitor: 0 steps, 0 skipped; health: clean.')
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 100,
        window: int = 200,
        max_consecutive_skips: int = 10,
        max_skip_rate: float = 0.05,
        on_pathological: Literal["warn", "raise"] = "warn",
        trace_nonfinite: bool = False,
        plot_path: str | os.PathLike[str] | None = None,
    ) -> None:
        validate_policy("LossScaleMonitor", warmup_steps, window, max_consecutive_skips, max_skip_rate)
        validate_monitor_options(on_pathological, trace_nonfinite, plot_path)
        self._health = SkipHealth(warmup_steps, window, max_consecutive_skips, max_skip_rate)
        self.on_pathological = on_pathological
        self.trace_nonfinite = trace_nonfinite
        self.plot_path = None if plot_path is None else Path(plot_path)
        self.plot_events: list[tuple[int, str]] = []
        self._records: list[ScaleRecord] = []
        self._plugin: _Plugin | None = None
        self._tracer: diagnostics.NonFiniteTracer | None = None
        self._progress = 0  # scaler updates (or global steps for bf16) before this batch
        self._named_first_incident = False
        self._restored = False
        self._published = -1  # the progress count at which amp/* last went into callback_metrics
        self._unguarded = False  # the plugin's guard is off: nothing is skipped, so nothing is "clean"
        self._quieted: LossScaler | None = None  # the guard whose own warnings the monitor speaks for
        self._pending: list[tuple[int, Tensor]] = []  # fused steps' skip flags, read at the next logged step

    # -- what users read ----------------------------------------------------------------------

    @property
    def health(self) -> HealthState:
        """The current health state (see :class:`SkipHealth`)."""
        return self._health.state

    @property
    def history(self) -> list[ScaleRecord]:
        """Samples taken on logged and skipped steps (thinned to every other one past 10,000)."""
        return list(self._records)

    def summary(self) -> str:
        """One line: steps, skips, last scale, health."""
        h = self._health
        text = f"LossScaleMonitor: {h.steps} steps, {h.skipped} skipped"
        if h.warmup_skipped:
            text += f" ({h.warmup_skipped} in warm-up)"
        if h.flags:
            text += f", skip rate {h.skip_rate:.1%} over the last {len(h.flags)} steps"
        scales = [r.scale for r in self._records if not math.isnan(r.scale)]
        if scales:
            text += f", scale {scales[-1]:g}"
        return f"{text}; health: {'unguarded' if self._unguarded else h.state}."

    # -- set-up and tear-down -----------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        if not isinstance(plugin, (AMPPrecision, AMPFSDPPrecision)):
            raise TypeError(
                f"LossScaleMonitor reads amp_plugin.AMPPrecision, but the Trainer's precision plugin is "
                f"{type(plugin).__name__}. HINT: pass Trainer(plugins=[AMPPrecision('16-mixed')]) (or "
                "'bf16-mixed'; under FSDPStrategy, FSDPStrategy(precision_plugin=AMPFSDPPrecision(...))), "
                "or remove the monitor."
            )
        self._plugin = plugin
        if not trainer.loggers:
            rank_zero_info(
                "LossScaleMonitor: the Trainer has no logger, so amp/* is not logged; the monitor still "
                "checks health and keeps its summary (LossScaleMonitor.summary(), printed at the end of fit)."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plugin = self._require_plugin()
        scaler, guard = plugin.scaler, plugin.guard
        if guard is None:
            rank_zero_warn(
                "LossScaleMonitor: the plugin's guard is off (guard=False), so steps with inf/NaN "
                "gradients are applied and never counted as skipped; health reads 'unguarded'.\nHINT: drop "
                "guard=False to have such steps skipped and reported."
            )
        elif scaler is None:
            # Only fp16 needs scaling; say why in the terms of the precision the run has.
            why = "fp32 gradients do not underflow" if "32" in plugin.precision else "bf16 has fp32's range"
            rank_zero_info(
                f"LossScaleMonitor: {plugin.precision} needs no loss scaler ({why}), so amp/scale is not "
                "logged;\n  its guard still skips steps with inf/NaN gradients: amp/grad_norm, "
                "amp/skipped_steps and amp/skip_rate are logged."
            )
        if guard is not None and not self._restored and self._health.steps == 0:
            # Added to a run that already trained: start from the guard's own counters.
            self._health.steps, self._health.skipped = guard.total_steps, guard.skipped_steps
        self._unguarded = guard is None
        if guard is not None:  # the monitor reports floors and skip runs itself, once: the guard goes quiet
            guard.warn_on_skips = False
            self._quieted = guard
        clip = _clipping(trainer)
        if clip is not None and clip[0] == GradClipAlgorithmType.VALUE:
            rank_zero_info(
                "LossScaleMonitor: with value clipping amp/grad_norm_clipped is not logged (it would cost "
                "another pass over the gradients); amp/grad_norm (before clipping) is."
            )
        self._health.min_scale = None if scaler is None else scaler.min_scale
        self._health.scaled = scaler is not None  # bf16/fp32: no warm-up, a skip is a real inf/NaN
        scale = math.nan if scaler is None else scaler.get_scale()  # the restored scale after a resume
        self._record(ScaleRecord(trainer.global_step, scale, self._health.skipped, math.nan, False))
        self._progress = self._progress_count(trainer)
        if self.trace_nonfinite:
            self._tracer = diagnostics.NonFiniteTracer(pl_module).attach()
        self._log_fp8(trainer, plugin)

    def _log_fp8(self, trainer: Trainer, plugin: _Plugin) -> None:
        """Once per fit, with ``fp8=``: how many Linear layers and what share of their parameters run fp8."""
        report = plugin.fp8_report
        if report is None or not trainer.loggers or not trainer.is_global_zero:
            return
        share = report.converted_parameters / report.linear_parameters if report.linear_parameters else 0.0
        metrics = {"amp/fp8_layers": float(len(report.converted)), "amp/fp8_param_share": share}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._publish_if_stale(trainer)  # a mid-epoch validation's on_validation_end checks see them
        if self._tracer is not None:
            self._tracer.detach()  # validation steps nothing; its forward passes would only cost

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._tracer is not None:  # it exists only between the start and the end of training
            self._tracer.reset()
            self._tracer.attach()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rank_zero_info(self.summary())
        self._writeplot_history(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()
        self._writeplot_history(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach()
        if self._quieted is not None:  # outside fit the guard speaks for itself again
            self._quieted.warn_on_skips = True
            self._quieted = None

    # -- per step -----------------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        plugin = self._require_plugin()
        self._progress = self._progress_count(trainer)
        clip = _clipping(trainer)
        if _compat.should_update_logs(trainer) and (clip is None or clip[0] != GradClipAlgorithmType.NORM):
            plugin.request_grad_norm()  # a norm clip computes it anyway; otherwise only on logged steps

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        plugin = self._require_plugin()
        if self._progress_count(trainer) == self._progress:
            return  # accumulating gradients (or no step at all): nothing happened to the scaler
        driver = plugin.driver
        flag = (
            False if driver is None else driver.last_skip
        )  # a bool where the step read it; else the device flag
        sample = _compat.should_update_logs(trainer)
        epoch_done = _compat.epoch_training_done(trainer)
        if isinstance(flag, Tensor) and not (sample or epoch_done or self._tracer is not None):
            # A fused step skipped (or not) on the device: read it with the next logged step's, at once.
            self._pending.append((trainer.global_step, flag))
            return
        steps = [*self._pending, (trainer.global_step, flag)]
        self._pending = []
        flags = read_flags([f for _, f in steps])
        for (step, _), skipped in zip(steps[:-1], flags, strict=False):
            self._observe(plugin, pl_module, trainer, step, skipped, sample=False, current=False)
        self._observe(plugin, pl_module, trainer, trainer.global_step, flags[-1], sample, current=True)
        if self._tracer is not None:
            self._tracer.reset()
        if epoch_done:
            self._publish_if_stale(trainer)  # EarlyStopping and ModelCheckpoint look at the epoch's end

    def _observe(
        self, plugin: _Plugin, pl_module: LightningModule, trainer: Trainer, step: int, skipped: bool,
        sample: bool, current: bool,
    ) -> None:  # fmt: skip
        """Judge one optimizer step: this batch's (``current``) or a fused one read late; log if ``sample``.

        A step read late has no gradient norm of its own any more: the plugin holds this batch's.
        """
        scaler = plugin.scaler
        scale = scaler.get_scale() if scaler is not None and (skipped or sample) else None
        verdict = self._health.observe(skipped, scale)
        tracer = self._tracer
        seen = tracer is not None and (tracer.forward_record or tracer.backward_record) is not None
        # Unguarded steps never skip: what the tracer saw is the news.
        incident = skipped or (plugin.guard is None and seen)
        if incident or sample:
            norm = plugin.last_grad_norm if current else None
            grad_norm = None if norm is None else float(norm.item())  # NaN on a step with a NaN gradient
            record = ScaleRecord(
                step,
                math.nan if scale is None else scale,
                self._health.skipped,
                math.nan if grad_norm is None else grad_norm,
                skipped,
            )
            self._record(record)
            if sample:
                self._publish(trainer, record, grad_norm, log=True)
        # A skip while fp16's scale calibrates is expected, and every gradient of it overflowed: naming
        # them says nothing. The forensics wait for the first skip after warm-up, or for an inf/NaN the
        # tracer saw in a forward pass (which no loss scale causes).
        in_forward = tracer is not None and tracer.forward_record is not None
        calibrating = skipped and self._health.state == "warm-up" and not in_forward
        first = incident and not calibrating and not self._named_first_incident
        if verdict is not None or first:
            self._named_first_incident |= incident and not calibrating
            forensics = first or (incident and _is_pathological(verdict))  # no inf/NaN to name otherwise
            self._announce(pl_module, verdict, forensics)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._publish_if_stale(trainer)  # an epoch cut short (trainer.should_stop) ends here

    # -- checkpoints --------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"health": self._health.state_dict(), "records": [tuple(r) for r in self._records]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; every entry is checked before anything changes."""
        health, records = check_monitor_state(state_dict)
        self._health.load_state_dict(health)  # checked already: cannot fail half-way
        self._records = records
        self._restored = True

    # -- internals ----------------------------------------------------------------------------

    def _require_plugin(self) -> _Plugin:
        if self._plugin is None:
            raise RuntimeError(
                "LossScaleMonitor was called outside Trainer.fit (setup(stage='fit') did not run). "
                "HINT: add it to Trainer(callbacks=[...]) and call trainer.fit()."
            )
        return self._plugin

    def _progress_count(self, trainer: Trainer) -> int:
        guard = self._require_plugin().guard
        # The guard's update count is exact: a batch whose backward was skipped steps Lightning, not it.
        return trainer.global_step if guard is None else guard.total_steps

    def _publish(self, trainer: Trainer, record: ScaleRecord, grad_norm: float | None, log: bool) -> None:
        """Put ``record``'s metrics into ``callback_metrics`` (every rank) and, if ``log``, the loggers.

        ``grad_norm``: the step's norm, ``None`` where it was not computed (the record's NaN may be
        either that or a NaN gradient's norm, which is logged).
        """
        plugin = self._require_plugin()
        scaler, guard = plugin.scaler, plugin.guard
        # The guard's count is the truth (it is in the checkpoint; reading it here, free where the steps
        # read their flags, is also what a fused optimizer's scheduler hold waits for). Unguarded: the
        # monitor's own count.
        skipped = self._health.skipped if guard is None else guard.skipped_steps
        metrics = amp_metrics(scaler, record.scale, skipped, self._health.skip_rate, grad_norm,
                              _clipping(trainer))  # fmt: skip
        publish(trainer, metrics)
        self._published = self._progress_count(trainer)
        if log and trainer.loggers and trainer.is_global_zero:
            # Straight to the loggers, at the step Lightning files this batch's own metrics under (as its
            # LearningRateMonitor does): LightningModule.log would cost about 1 ms per metric and call.
            step = _compat.logged_step(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _publish_if_stale(self, trainer: Trainer) -> None:
        """Before EarlyStopping/ModelCheckpoint look: the current values, if not published at this step."""
        if self._plugin is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._published == self._progress_count(trainer):
            return
        scaler, norm = self._plugin.scaler, self._plugin.last_grad_norm
        scale = math.nan if scaler is None else scaler.get_scale()  # one sync, once per epoch or validation
        grad_norm = None if norm is None else float(norm.item())  # this step's, if it was computed
        known = math.nan if grad_norm is None else grad_norm
        record = ScaleRecord(trainer.global_step, scale, self._health.skipped, known, False)
        self._publish(trainer, record, grad_norm, log=False)

    def _announce(self, pl_module: LightningModule, verdict: HealthVerdict | None, forensics: bool) -> None:
        if verdict is None:
            head = f"step {self._health.steps} was skipped (health: {self._health.state})"
        else:
            head = verdict.reason
        lines = [f"LossScaleMonitor: {head}."]
        pathological = _is_pathological(verdict)
        if pathological:
            lines += self._recent_history()
        if forensics:
            lines += self._forensics(pl_module, hint=pathological)
        message = "\n".join(lines)
        if not pathological:
            rank_zero_info(message)
        elif self.on_pathological == "raise":
            raise RuntimeError(
                f"{message}\nHINT: fix the source named above (AMPPrecision(fp32_modules=...) for a module "
                "that overflows, a lower learning rate, or bf16), or pass on_pathological='warn' to go on."
            )
        else:
            rank_zero_warn(message)

    def _recent_history(self) -> list[str]:
        h = self._health
        flags = list(h.flags)[-SHOWN_FLAGS:]
        first = h.steps - len(flags) + 1
        spelled = "".join("x" if f else "." for f in flags)
        scales = [f"{r.step}: {r.scale:g}" for r in self._records[-8:] if not math.isnan(r.scale)]
        lines = [f"Steps {first}-{h.steps} (x = skipped): {spelled}"]
        if scales:
            lines.append("Recent scale (step: scale): " + ", ".join(scales))
        return lines

    def _forensics(self, pl_module: LightningModule, hint: bool) -> list[str]:
        bad = diagnostics.nonfinite_gradients(pl_module.named_parameters(), limit=5)
        if bad:
            # One parameter a line: five long names on one line overran a terminal and the examples' tables.
            lines = ["Non-finite gradients: " + ";\n  ".join(str(g) for g in bad)]
        else:
            lines = [
                "No gradient on this rank holds inf/NaN now (another rank overflowed, or they were cleared)."
            ]
        if self._tracer is not None:
            lines.append(
                self._tracer.report() or "The tracer saw no non-finite output or gradient in this step."
            )
        elif hint:
            lines.append(
                "HINT: LossScaleMonitor(trace_nonfinite=True) names the first module that produced them."
            )
        return lines

    def _record(self, record: ScaleRecord) -> None:
        self._records.append(record)
        if len(self._records) > _MAX_RECORDS:
            self._records = self._records[::2] + ([record] if len(self._records) % 2 == 0 else [])

    def _detach(self) -> None:
        if self._tracer is not None:
            self._tracer.detach()
            self._tracer = None

    def _writeplot_history(self, trainer: Trainer) -> None:
        if self.plot_path is None or not trainer.is_global_zero:
            return
        try:
            plot_history(self._records, self.plot_path, self._health, self.plot_events)
            rank_zero_info(f"LossScaleMonitor: plot of the loss scale and skips written to {self.plot_path}")
        except Exception as err:  # the run is over; a failed picture must not turn it into a failure
            rank_zero_warn(f"LossScaleMonitor could not write the plot to {self.plot_path}: {err!r}")


def _clipping(trainer: Trainer) -> tuple[GradClipAlgorithmType, float] | None:
    """The Trainer's gradient clipping (algorithm, value), or ``None`` when it is off."""
    clip_val = trainer.gradient_clip_val
    if clip_val is None or clip_val <= 0:
        return None
    return GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm"), float(clip_val)


def _is_pathological(verdict: HealthVerdict | None) -> bool:
    return verdict is not None and verdict.state == "pathological"
