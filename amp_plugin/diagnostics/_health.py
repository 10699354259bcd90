"""Run health from the loss scaler's skip history: warm-up, sporadic or pathological.

Plain Python (no Lightning): :class:`SkipHealth` classifies a stream of skip flags;
:mod:`~amp_plugin.diagnostics._health_state` checks what it and the monitor save, and
:func:`~amp_plugin.diagnostics._health_plot.plot_history` draws the scale and the skips.
:class:`~amp_plugin.LossScaleMonitor` feeds them from a Trainer.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from amp_plugin import _imports
from amp_plugin._scale_policy import STREAK_WARNING_AT
from amp_plugin._validation import check_bool, check_choice, check_int, check_number, fail
from amp_plugin.diagnostics._health_state import HealthState, check_health_state, number_or_none

__all__ = [
    "HealthVerdict",
    "SkipHealth",
    "validate_monitor_options",
    "validate_policy",
]

SHOWN_FLAGS = 50  # recent steps spelled out in a pathological report


@dataclass(frozen=True)
class HealthVerdict:
    """A change of health: the new state, why (in words), and after how many steps.

    Example:
        >>> SkipHealth(warmup_steps=0).observe(True).state
        'sporadic'
    """

    state: HealthState
    reason: str
    step: int


class SkipHealth:
    """The health of a loss-scaled run, from its per-step skip flags and (when known) its scale.

    States, in words:

    * ``"clean"``: no step skipped outside warm-up.
    * ``"warm-up"``: steps skipped within the first ``warmup_steps``, while a too-high initial
      scale backs off to one the gradients fit (normal).
    * ``"sporadic"``: rare skips after warm-up: the scale grew once too far and backed off (normal).
    * ``"pathological"``: after warm-up, ``max_consecutive_skips`` steps skipped in a row, or more
      than ``max_skip_rate`` of the last ``window`` steps skipped; within warm-up, 25 steps in a row
      (``STREAK_WARNING_AT``, or ``max_consecutive_skips`` if larger); or, at any time, the scale at
      the scaler's ``min_scale``, or below 1 without one (the gradients overflow unscaled). It
      returns to ``"sporadic"`` when none of these holds any more.

    Args:
        warmup_steps: how many first steps may skip as the scale calibrates.
        window: how many recent steps the skip rate covers.
        max_consecutive_skips: skipped steps in a row (after warm-up) that are pathological.
        max_skip_rate: the skip rate over a full window (of post-warm-up steps) above which the run is
            pathological.
        min_scale: the scaler's ``min_scale`` (``None`` without one).

    Example:
        >>> health = SkipHealth(warmup_steps=2, window=4, max_consecutive_skips=3, max_skip_rate=0.5)
        >>> flags = [True, True, False, False, True, False, True, True, True]
        >>> [(v.step, v.state) for f in flags if (v := health.observe(f)) is not None]
        [(1, 'warm-up'), (3, 'clean'), (5, 'sporadic'), (8, 'pathological')]
    """

    def __init__(
        self,
        warmup_steps: int = 100,
        window: int = 200,
        max_consecutive_skips: int = 10,
        max_skip_rate: float = 0.05,
        min_scale: float | None = None,
    ) -> None:
        validate_policy("SkipHealth", warmup_steps, window, max_consecutive_skips, max_skip_rate)
        self.min_scale = number_or_none("SkipHealth", "min_scale", min_scale, "pass the scaler's min_scale.")
        self.warmup_steps, self.window = warmup_steps, window
        self.max_consecutive_skips, self.max_skip_rate = max_consecutive_skips, max_skip_rate
        self.state: HealthState = "clean"
        self.steps = self.skipped = self.warmup_skipped = self.consecutive = 0
        self.scale: float | None = None  # the last one known
        # A loss scale calibrates (fp16): its first steps are warm-up. Without one (bf16, fp32) a skip is
        # a real inf/NaN from the first step on (the monitor sets this at fit start).
        self.scaled = True
        self.flags: deque[bool] = deque(maxlen=window)
        self._window_skips = 0  # sum(flags), kept as it goes

    @property
    def skip_rate(self) -> float:
        """The fraction of skipped steps among the last ``window`` (fewer at the start) steps."""
        return self._window_skips / len(self.flags) if self.flags else 0.0

    def observe(self, skipped: bool, scale: float | None = None) -> HealthVerdict | None:
        """Account for one optimizer step; return a verdict when the state changes, else ``None``.

        Raises:
            TypeError / ValueError: ``skipped`` is not a bool, or ``scale`` is neither ``None`` nor a
                finite number >= 0 (nothing is counted then).
        """
        check_bool("SkipHealth.observe", "skipped", skipped)
        scale = number_or_none(
            "SkipHealth.observe", "scale", scale, "pass LossScaler.get_scale().", zero=True
        )
        self.steps += 1
        if len(self.flags) == self.window:
            self._window_skips -= self.flags[0]
        self.flags.append(skipped)
        self._window_skips += skipped
        self.consecutive = self.consecutive + 1 if skipped else 0
        in_warmup = self.steps <= self._warmup
        self.skipped += skipped
        self.warmup_skipped += skipped and in_warmup
        if scale is not None:
            self.scale = scale
        state, reason = self._classify(skipped, in_warmup)
        if state == self.state:
            return None
        self.state = state
        return HealthVerdict(state, reason, self.steps)

    @property
    def _warmup(self) -> int:
        """The warm-up steps that apply: ``warmup_steps`` with a loss scale, none without one."""
        return self.warmup_steps if self.scaled else 0

    def _classify(self, skipped: bool, in_warmup: bool) -> tuple[HealthState, str]:
        problems = []
        scale, floor = self.scale, self.min_scale
        if scale is not None and floor is not None and scale <= floor * (1 + 1e-6):  # fp32 rounding of floor
            problems.append(
                f"the scale sits at min_scale={floor:g}: it cannot back off further, so each overflow is a "
                "lost step"
            )
        elif scale is not None and floor is None and scale < 1:
            problems.append(
                f"the scale fell to {scale:g}: below 1 the gradients overflow even unscaled, which no scale "
                "calibrates (LossScaler(min_scale=1.0) floors it, as DeepSpeed and Megatron do)"
            )
        # A run this long is never warm-up: the scaler alone would warn about it (SkipStreakWarning).
        limit = self.max_consecutive_skips
        if in_warmup:
            limit = max(limit, STREAK_WARNING_AT)
        if self.consecutive >= limit:
            problems.append(f"{self.consecutive} steps in a row were skipped (limit {limit})")
        window_after_warmup = len(self.flags) == self.window and self.steps - self.window >= self._warmup
        if window_after_warmup and self.skip_rate > self.max_skip_rate:
            problems.append(
                f"{self.skip_rate:.1%} of the last {self.window} steps were skipped "
                f"(limit {self.max_skip_rate:.1%})"
            )
        if problems:
            return "pathological", "; ".join(problems)
        if self.state == "pathological":
            return "sporadic", f"recovered: {self._window_skips} of the last {len(self.flags)} steps skipped"
        if skipped and in_warmup:
            return "warm-up", (
                f"step {self.steps} was skipped while the loss scale calibrates (the first "
                f"{self.warmup_steps} steps are warm-up); this is normal"
            )
        if skipped and not self.scaled:
            return "sporadic", (
                f"step {self.steps} was skipped: its loss or a gradient was inf/NaN (no loss scale was "
                "involved); the guard left the weights and the optimizer state as they were"
            )
        if skipped:
            return "sporadic", (
                f"step {self.steps} was skipped after warm-up; rare skips are normal (the scale backs off, "
                "then grows again)"
            )
        if self.state == "warm-up" and not in_warmup:
            return (
                "clean",
                f"warm-up is over: {self.warmup_skipped} steps were skipped while the scale calibrated",
            )
        return self.state, ""

    def state_dict(self) -> dict[str, Any]:
        """Counters, recent flags and state as plain values (``torch.load(weights_only=True)`` reads them)."""
        return {
            "state": self.state,
            "steps": self.steps,
            "skipped": self.skipped,
            "warmup_skipped": self.warmup_skipped,
            "consecutive": self.consecutive,
            "scale": self.scale,
            "flags": list(self.flags),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the policy stays this object's).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: an entry is missing, of the wrong type, or impossible (more skipped steps than
                steps, flags that contradict the counts); checked in full before anything changes.
        """
        state = check_health_state(state_dict, "SkipHealth.load_state_dict")
        self.state = state["state"]
        self.steps, self.skipped = state["steps"], state["skipped"]
        self.warmup_skipped, self.consecutive = state["warmup_skipped"], state["consecutive"]
        self.scale = state["scale"]
        self.flags = deque(state["flags"], maxlen=self.window)
        self._window_skips = sum(self.flags)


def validate_policy(
    owner: str, warmup_steps: object, window: object, consecutive: object, rate: object
) -> None:
    """Check :class:`SkipHealth`'s policy arguments, as passed to ``owner``.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range, named with ``owner``.

    Example:
        >>> validate_policy("SkipHealth", 100, 0, 10, 0.05)
        Traceback (most recent call last):
        ...
        ValueError: SkipHealth(window=0) is not allowed here: it is below 1. Allowed: an int >= 1. HINT: ...
    """
    check_int(
        owner, "warmup_steps", warmup_steps, low=0, hint="100 covers a scale calibrating down from 2**16."
    )
    check_int(owner, "window", window, low=1, hint="200 steps is the default.")
    check_int(
        owner,
        "max_consecutive_skips",
        consecutive,
        low=1,
        hint="10 is the default; with LossScaler(hysteresis=h) allow well over h.",
    )
    check_number(
        owner,
        "max_skip_rate",
        rate,
        low=0.0,
        low_open=True,
        high=1.0,
        hint="0.05 flags runs that skip over 5% of steps.",
    )


def validate_monitor_options(on_pathological: object, trace_nonfinite: object, plot_path: object) -> None:
    """Check ``LossScaleMonitor``'s options other than the policy.

    Raises:
        TypeError / ValueError: an option of the wrong type or value.
        ImportError: ``plot_path`` is given but matplotlib is not installed.

    Example:
        >>> validate_monitor_options("warn", False, None)
        >>> validate_monitor_options("stop", False, None)
        Traceback (most recent call last):
        ...
        ValueError: LossScaleMonitor(on_pathological='stop') is not allowed here: it is none of ...
    """
    call = "LossScaleMonitor"
    check_choice(
        call,
        "on_pathological",
        on_pathological,
        ("warn", "raise"),
        "'raise' stops training with the history in the error.",
    )
    check_bool(call, "trace_nonfinite", trace_nonfinite)
    if plot_path is not None and not isinstance(plot_path, (str, os.PathLike)):
        fail(
            call,
            passed=f"plot_path={plot_path!r}",
            allowed="None or a file path",
            hint="pass e.g. 'loss_scale.png'.",
            error=TypeError,
        )
    if plot_path is not None and not _imports.matplotlib_available():
        raise ImportError(
            f"LossScaleMonitor(plot_path={str(plot_path)!r}) needs matplotlib, which is not installed. "
            "HINT: pip install 'amp_plugin[examples]' (or pip install matplotlib), or drop plot_path."
        )
