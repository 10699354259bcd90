"""The loss scale on the device and the rule that moves it.

:class:`DynamicScale` owns the scale tensor and its trackers and applies, once per
iteration, torch's growth/backoff rule (``torch._amp_update_scale_``, bit for bit), Apex's
hysteresis (back off from the h-th overflowing step in a row on), the ``min_scale`` /
``max_scale`` bounds, and a floor at the smallest normal fp32. It also counts the skipped
iterations: on the host where the caller read the skip flag already, else by keeping the
flag and reading all kept flags at once later. Nothing here reads a value back to the host,
except once every 100 updates (the floor and the kept flags) and where a caller asks for a
number. :class:`~amp_plugin.LossScaler` drives it; the per-optimizer protocol (unscale, skip,
clip) lives there.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from amp_plugin import _scaler_rules
from amp_plugin._validation import check_bool

__all__ = ["STREAK_WARNING_AT", "DynamicScale", "ScaleFloorWarning", "SkipStreakWarning"]

_FLOOR_CHECK_EVERY = 100  # updates between the host reads that look for a scale stuck at its floor
_TRACKERS = ("growth_tracker", "hysteresis_tracker", "floor_step")


class ScaleFloorWarning(RuntimeWarning):
    """The loss scale backed off to its floor: gradients overflow whatever the scale.

    Said once per scaler, with the step and a hint. Escalate it to an error with
    :mod:`warnings` filters where a run should stop instead.

    Example:
        >>> import warnings
        >>> s = DynamicScale(2.0, 2.0, 0.5, 2000, min_scale=2.0)
        >>> _ = s.ensure(torch.device("cpu"))
        >>> s.update_(torch.tensor(1.0))  # an overflow at the floor
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = s.value()
        >>> [type(w.message).__name__ for w in caught]
        ['ScaleFloorWarning']
    """


class SkipStreakWarning(RuntimeWarning):
    """Many optimizer steps in a row were skipped for inf/NaN: no harm to the weights, but no training.

    Said once per scaler (or guard), when :data:`STREAK_WARNING_AT` iterations in a row were
    skipped (noticed at once where the step read the flag, else at the next check, every 100
    updates), in every precision, unless ``LossScaleMonitor`` reports the run instead.

    Example:
        >>> import warnings
        >>> s = DynamicScale(1.0, 2.0, 0.5, 2000, dynamic=False)  # a guard's static scale of 1
        >>> _ = s.ensure(torch.device("cpu"))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(STREAK_WARNING_AT):
        ...         s.update_(torch.tensor(1.0), skipped=True)
        >>> [type(w.message).__name__ for w in caught]
        ['SkipStreakWarning']
    """


#: Skipped iterations in a row that :class:`SkipStreakWarning` reports (fp16's warm-up from 2**16
#: to a working scale takes well under 20).
STREAK_WARNING_AT = 25


class DynamicScale:
    """The scale and its trackers (device tensors, created on first use) and their update rule.

    Args: as :class:`~amp_plugin.LossScaler`'s of the same names; validated here.

    Example:
        >>> s = DynamicScale(8.0, 2.0, 0.5, 2000, min_scale=2.0)
        >>> _ = s.ensure(torch.device("cpu"))
        >>> for _ in range(2):
        ...     s.update_(torch.tensor(1.0))  # two overflows in a row: 8 -> 4 -> 2, the floor
        >>> s.value(), s.skipped_steps(), s.total_steps
        (2.0, 2, 2)
    """

    def __init__(
        self,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
    ) -> None:
        _scaler_rules.check_config(
            init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        self.dynamic = check_bool("LossScaler", "dynamic", dynamic)
        self.init_scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = min_scale, max_scale
        self.total_steps = 0
        self._start = (0, self.hysteresis)  # growth and hysteresis trackers: taken by ensure()
        self.scale: Tensor | None = None
        self.growth_tracker = self.hysteresis_tracker = self.floor_step = torch.zeros(())
        self._floor_reported = False
        self.report = True  # warn about a scale at its floor and long skip runs (unless a monitor does)
        # What the host knows of the closed iterations: skipped ones, the skip of the last one, the
        # current run of skips and the longest. Flags not read yet wait in _pending, in order, until
        # one read takes them all (every 100 updates, or when a number is asked for).
        self.skipped_seen = 0
        self._last = False
        self._streak = self._longest = 0
        self._pending: list[Tensor | bool] = []
        self._streak_reported = False

    @property
    def floor(self) -> float:
        """The lowest scale: ``min_scale``, or the smallest normal fp32 (2**-126) without one."""
        return _scaler_rules.SCALE_FLOOR if self.min_scale is None else self.min_scale

    def ensure(self, device: torch.device) -> Tensor:
        """The scale tensor, created on ``device`` (with its trackers) on first use."""
        if self.scale is not None:
            return self.scale
        growth, hyst = self._start
        self.scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), growth, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full((), hyst, dtype=torch.int32, device=device)
        self.floor_step = torch.full((), -1, dtype=torch.int64, device=device)
        return self.scale

    def update_(
        self, found_inf: Tensor, skipped: bool | None = None, skip_flag: Tensor | None = None
    ) -> None:
        """Close an iteration whose combined inf flag is ``found_inf`` (> 0: its steps were skipped).

        ``skipped``: whether the steps were skipped, where the caller has already read it on the
        host (no read here). ``skip_flag``: the device flag of the skip where it is wider than
        ``found_inf`` (a loss spike skips without moving the scale); counted instead of it.
        Besides the scale's own rule (dynamic scales only) this launches nothing: the flag is kept
        (not copied; the caller does not change it afterwards) and counted when it is next read.
        """
        scale = self._require()
        if self.dynamic:
            # A step known clean on the host needs no floor bookkeeping: a clean step never lowers
            # the scale, and every update leaves it at or above the floor.
            kept = None if skip_flag is None else [t.clone() for t in self._trackers_now(scale)]
            self._move(scale, found_inf, track_floor=skipped is not False)
            if kept is not None and skip_flag is not None:
                # A skip that was no overflow (a loss spike) leaves the scale and its trackers as
                # they were: for the scale that step did not happen.
                hold = (skip_flag > 0) & (found_inf <= 0)
                for tensor, before in zip(self._trackers_now(scale), kept, strict=True):
                    tensor.copy_(torch.where(hold, before, tensor))
        self.count_(found_inf if skip_flag is None else skip_flag, skipped)
        if self.total_steps % _FLOOR_CHECK_EVERY == 0:
            self.report_floor()
            self._report_streak()  # one read of the waiting flags, every 100 updates

    def count_(self, flag: Tensor, skipped: bool | None = None) -> None:
        """Count one closed iteration whose skip flag is ``flag`` (> 0: skipped), the scale left alone.

        ``skipped``: the flag as the caller already read it (no read here); else the flag waits,
        unread, until the counts are next read.
        """
        self.total_steps += 1
        if skipped is None or self._pending:  # behind an unread flag, a known one waits its turn
            self._pending.append(flag if skipped is None else skipped)
        else:
            self._count(skipped)

    def _trackers_now(self, scale: Tensor) -> tuple[Tensor, ...]:
        return (scale, self.growth_tracker, self.hysteresis_tracker)

    def _count(self, skipped: bool) -> None:
        """Count one closed iteration on the host, in order."""
        self._last = skipped
        self.skipped_seen += skipped
        self._streak = self._streak + 1 if skipped else 0
        self._longest = max(self._longest, self._streak)
        if self._streak == STREAK_WARNING_AT:
            self._report_streak()

    def _read(self, *extra: Tensor) -> list[int]:
        """Count the waiting flags (one host read, shared with ``extra``); return ``extra``'s values."""
        pending, self._pending = self._pending, []
        flags = [flag for flag in pending if isinstance(flag, Tensor)]
        values: list[float] = []
        if flags or extra:
            device = self._require().device
            # One dtype per stack (int32 trackers, fp32 flags); fp64 holds every one of them exactly.
            parts = [
                torch.stack([t.reshape(()).to(device, _stack_dtype(t)) for t in group]).double()
                for group in (extra, flags)
                if group
            ]
            values = torch.cat(parts).tolist()
        read = iter(values[len(extra) :])
        for flag in pending:
            self._count(flag if isinstance(flag, bool) else next(read) > 0)
        return [int(value) for value in values[: len(extra)]]

    def _report_streak(self) -> None:
        """Warn once (:class:`SkipStreakWarning`) about a long run of skipped iterations."""
        if self._pending:
            self._read()
        if self._streak_reported or self._longest < STREAK_WARNING_AT or not self.report:
            return
        self._streak_reported = True
        warnings.warn(
            # One short line each: a terminal or a log viewer shows the whole of it.
            f"LossScaler: {self._longest} optimizer steps in a row were skipped for inf/NaN gradients "
            f"(or losses), by step {self.total_steps}.\n"
            "No weight was changed by them, but the run is not training.\n"
            "HINT: find the first module that produces inf/NaN (LossScaleMonitor(trace_nonfinite=True) "
            "or amp_plugin.diagnostics.NonFiniteTracer); check the data and the learning rate.",
            SkipStreakWarning,
            stacklevel=4,
        )

    def set_(self, value: float | Tensor) -> None:
        """Set the scale by hand (validated by the caller); the trackers are kept."""
        scale = self._require()
        if isinstance(value, Tensor):
            scale.copy_(value)
        else:
            scale.fill_(value)

    def value(self) -> float:
        """The scale as a Python float (synchronises the host)."""
        if self.scale is None:
            return self.init_scale
        self.report_floor()
        return float(self.scale.item())

    def skipped_steps(self) -> int:
        """Iterations closed with an inf/NaN flag (one host read, unless every flag was read already)."""
        if self._pending:
            self._read()
        return self.skipped_seen

    def last_skipped(self) -> bool:
        """Whether the last closed iteration was skipped (one host read, unless its flag was read)."""
        if self._pending:
            self._read()
        return self._last

    def trackers(self) -> tuple[int, int, int]:
        """``(growth tracker, hysteresis tracker, skipped steps)`` as Python ints (one host read)."""
        if self.scale is None:
            return (*self._start, self.skipped_seen)
        growth, hyst = self._read(self.growth_tracker, self.hysteresis_tracker)
        return growth, hyst, self.skipped_seen

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys plus hysteresis, bounds, static mode and the step counts."""
        growth, hyst, skipped = self.trackers()
        return {
            "scale": self.value(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": growth,
            "hysteresis": self.hysteresis,
            "_hysteresis_tracker": hyst,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            "skipped_steps": skipped,
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state_dict: Any) -> None:
        """Validate the whole dict (:func:`~amp_plugin._scaler_rules.checked_state`), then load it."""
        sd = _scaler_rules.checked_state(state_dict, self.hysteresis, self.min_scale, self.max_scale)
        self.init_scale = float(sd["scale"])
        self.growth_factor, self.backoff_factor = float(sd["growth_factor"]), float(sd["backoff_factor"])
        self.growth_interval, self.hysteresis = int(sd["growth_interval"]), int(sd["hysteresis"])
        self.min_scale, self.max_scale = sd["min_scale"], sd["max_scale"]
        self.dynamic = bool(sd.get("dynamic", self.dynamic))
        self.total_steps = int(sd.get("total_steps", 0))
        hyst = int(sd.get("_hysteresis_tracker", self.hysteresis))
        self._start = (int(sd["_growth_tracker"]), hyst)
        self.skipped_seen, self._last, self._pending = int(sd.get("skipped_steps", 0)), False, []
        self._floor_reported = False
        if self.scale is not None:
            device, self.scale = self.scale.device, None
            self.ensure(device)

    def report_floor(self) -> None:
        """Warn once (:class:`ScaleFloorWarning`) if the scale has backed off to its floor."""
        if self._floor_reported or self.scale is None or not self.dynamic:
            return
        step = int(self.floor_step.item())
        if step < 0:
            return
        self._floor_reported = True
        if not self.report:
            return
        warnings.warn(
            f"LossScaler: the loss scale backed off to its floor {self.floor:g} at step {step} and the "
            "gradients still overflowed: they are inf/NaN whatever the scale, so every such step is skipped "
            "(no weight was changed by them). HINT: look for the first module that produces inf/NaN "
            "(amp_plugin.diagnostics.NonFiniteTracer or LossScaleMonitor(trace_nonfinite=True)), lower the "
            "learning rate, or train in bf16.",
            ScaleFloorWarning,
            stacklevel=4,
        )

    def __getstate__(self) -> dict[str, Any]:
        start, init_scale = self._start, self.init_scale
        if self.scale is not None:  # numbers only: spawn would send tensors through shared-memory fds
            growth, hyst, _ = self.trackers()  # counts the waiting flags too
            start, init_scale = (growth, hyst), self.value()
        state = self.__dict__.copy()
        state.update(init_scale=init_scale, _start=start, scale=None, _pending=[])
        for name in _TRACKERS:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        placeholder = torch.zeros(())
        for name in _TRACKERS:
            setattr(self, name, placeholder)

    def _require(self) -> Tensor:
        if self.scale is None:
            raise RuntimeError(
                "The loss scale is used before scale() created it. HINT: call scale(loss) first."
            )
        return self.scale

    def _move(self, scale: Tensor, found_inf: Tensor, track_floor: bool = True) -> None:
        growth = self.growth_tracker
        args = (self.growth_factor, self.backoff_factor, self.growth_interval)
        if self.hysteresis == 1:
            torch._amp_update_scale_(scale, growth, found_inf, *args)
        else:
            overflow = found_inf > 0
            self.hysteresis_tracker.copy_(
                torch.where(overflow, self.hysteresis_tracker - 1, torch.full_like(growth, self.hysteresis))
            )
            backoff = overflow & (self.hysteresis_tracker <= 0)
            before = scale.clone()
            torch._amp_update_scale_(scale, growth, backoff.float(), *args)
            held = overflow & ~backoff  # absorbed by hysteresis: skip, keep the scale, restart growth
            scale.copy_(torch.where(held, before, scale))
            growth.masked_fill_(held, 0)
        # The floor changes nothing while the scale is a normal fp32 number above min_scale.
        if track_floor:
            self.floor_step.masked_fill_((scale < self.floor) & (self.floor_step < 0), self.total_steps)
        if track_floor or self.max_scale is not None:  # a clean step only grows the scale: no floor
            scale.clamp_(self.floor, self.max_scale)


def _stack_dtype(t: Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype
