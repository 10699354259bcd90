"""Run health from the loss scaler's skip history: warm-up, sporadic or pathological.

Plain Python (no Lightning): :class:`SkipHealth` classifies a stream of skip flags, and
:func:`plot_history` draws the scale and the skips. :class:`~amp_plugin.LossScaleMonitor`
feeds both from a Trainer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = [
    "HealthState",
    "HealthVerdict",
    "ScaleRecord",
    "SkipHealth",
    "check_option",
    "plot_history",
    "validate_policy",
]

SHOWN_FLAGS = 50  # recent steps spelled out in a pathological report

HealthState = Literal["clean", "warm-up", "sporadic", "pathological"]


@dataclass(frozen=True)
class HealthVerdict:
    """A change of health: the new state, why (in words), and after how many steps."""

    state: HealthState
    reason: str
    step: int


class ScaleRecord(NamedTuple):
    """One sample of the run, taken on logged and on skipped steps.

    ``step`` counts optimizer steps done (``trainer.global_step``); ``scale`` and ``grad_norm``
    are NaN where unknown (bf16 has no scale; the norm exists on logged steps).
    """

    step: int
    scale: float
    skipped_steps: int
    grad_norm: float
    skipped: bool


class SkipHealth:
    """The health of a loss-scaled run, from its per-step skip flags and (when known) its scale.

    States, in words:

    * ``"clean"``: no step skipped outside warm-up.
    * ``"warm-up"``: steps skipped within the first ``warmup_steps``, while a too-high initial
      scale backs off to one the gradients fit (normal).
    * ``"sporadic"``: rare skips after warm-up: the scale grew once too far and backed off (normal).
    * ``"pathological"``: after warm-up, ``max_consecutive_skips`` steps skipped in a row, or more
      than ``max_skip_rate`` of the last ``window`` steps skipped; or, at any time, the scale at
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
        self.warmup_steps, self.window = warmup_steps, window
        self.max_consecutive_skips, self.max_skip_rate = max_consecutive_skips, max_skip_rate
        self.min_scale = min_scale
        self.state: HealthState = "clean"
        self.steps = self.skipped = self.warmup_skipped = self.consecutive = 0
        self.scale: float | None = None  # the last one known
        self.flags: deque[bool] = deque(maxlen=window)
        self._window_skips = 0  # sum(flags), kept as it goes

    @property
    def skip_rate(self) -> float:
        """The fraction of skipped steps among the last ``window`` (fewer at the start) steps."""
        return self._window_skips / len(self.flags) if self.flags else 0.0

    def observe(self, skipped: bool, scale: float | None = None) -> HealthVerdict | None:
        """Account for one optimizer step; return a verdict when the state changes, else ``None``."""
        self.steps += 1
        if len(self.flags) == self.window:
            self._window_skips -= self.flags[0]
        self.flags.append(skipped)
        self._window_skips += skipped
        self.consecutive = self.consecutive + 1 if skipped else 0
        in_warmup = self.steps <= self.warmup_steps
        self.skipped += skipped
        self.warmup_skipped += skipped and in_warmup
        if scale is not None:
            self.scale = scale
        state, reason = self._classify(skipped, in_warmup)
        if state == self.state:
            return None
        self.state = state
        return HealthVerdict(state, reason, self.steps)

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
        if not in_warmup and self.consecutive >= self.max_consecutive_skips:
            problems.append(
                f"{self.consecutive} steps in a row were skipped (limit {self.max_consecutive_skips})"
            )
        window_after_warmup = len(self.flags) == self.window and self.steps - self.window >= self.warmup_steps
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
            "state": self.state, "steps": self.steps, "skipped": self.skipped,
            "warmup_skipped": self.warmup_skipped, "consecutive": self.consecutive,
            "scale": self.scale, "flags": list(self.flags),
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the policy stays this object's)."""
        self.state = state_dict["state"]
        self.steps, self.skipped = int(state_dict["steps"]), int(state_dict["skipped"])
        self.warmup_skipped, self.consecutive = (
            int(state_dict["warmup_skipped"]),
            int(state_dict["consecutive"]),
        )
        self.scale = state_dict["scale"]
        self.flags = deque((bool(f) for f in state_dict["flags"]), maxlen=self.window)
        self._window_skips = sum(self.flags)


def plot_history(records: list[ScaleRecord], path: Path, health: SkipHealth) -> None:
    from matplotlib.figure import Figure  # an optional dependency, checked in __init__

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax_top, ax_skip = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    scaled = [r for r in records if not math.isnan(r.scale)]
    last = records[-1].step if records else 0
    if scaled and health.warmup_steps:
        for ax in (ax_top, ax_skip):
            ax.axvspan(
                0, min(health.warmup_steps, last), color="0.93", label="warm-up" if ax is ax_top else None
            )
    if scaled:
        ax_top.step([r.step for r in scaled], [r.scale for r in scaled], where="post", label="loss scale")
        skips = [r for r in scaled if r.skipped]
        ax_top.plot(
            [r.step for r in skips], [r.scale for r in skips], "x", color="tab:red", label="skipped step"
        )
        if health.min_scale is not None:
            ax_top.axhline(health.min_scale, color="0.4", linestyle="--", label="min_scale")
        ax_top.set_yscale("log", base=2)
        ax_top.set_ylabel("loss scale")
        ax_top.set_title(f"Loss scale and skipped steps (health: {health.state})")
    else:  # bf16: no scale to show; the unscaled gradient norm is the next best thing
        normed = [r for r in records if math.isfinite(r.grad_norm) and r.grad_norm > 0]
        ax_top.plot([r.step for r in normed], [r.grad_norm for r in normed], ".-", label="gradient norm")
        ax_top.set_yscale("log")
        ax_top.set_ylabel("gradient norm (unscaled)")
        ax_top.set_title(f"Gradient norm and skipped steps (no loss scale; health: {health.state})")
    ax_top.legend(loc="best", fontsize="small")
    ax_skip.step([r.step for r in records], [r.skipped_steps for r in records], where="post", color="tab:red")
    ax_skip.set_ylabel("skipped steps")
    ax_skip.set_xlabel("global step")
    for ax in (ax_top, ax_skip):
        ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def check_option(ok: bool, what: str, allowed: str, hint: str, owner: str = "LossScaleMonitor") -> None:
    if not ok:
        raise ValueError(f"{owner}({what}) is not allowed: {allowed}. HINT: {hint}")


def validate_policy(
    owner: str, warmup_steps: object, window: object, consecutive: object, rate: object
) -> None:
    def count(x: object, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    rules = [
        (count(warmup_steps, 0), f"warmup_steps={warmup_steps!r}", "an int >= 0",
         "100 covers a scale calibrating down from 2**16."),
        (count(window, 1), f"window={window!r}", "an int >= 1", "200 steps is the default."),
        (count(consecutive, 1), f"max_consecutive_skips={consecutive!r}", "an int >= 1",
         "10 is the default; with LossScaler(hysteresis=h) allow well over h."),
        (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= 1,
         f"max_skip_rate={rate!r}", "a number in (0, 1]", "0.05 flags runs that skip over 5% of steps."),
    ]  # fmt: skip
    for ok, what, allowed, hint in rules:
        check_option(ok, what, allowed, hint, owner)
