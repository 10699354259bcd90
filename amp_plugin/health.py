"""Run health from the loss scaler's skip history: warm-up, sporadic or pathological.

Plain Python (no Lightning): :class:`SkipHealth` classifies a stream of skip flags, and
:func:`plot_history` draws the scale and the skips. :class:`~amp_plugin.LossScaleMonitor`
feeds both from a Trainer.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, NoReturn, get_args

from amp_plugin._validation import check_bool, check_choice, check_int, check_number, fail, is_number

__all__ = [
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

SHOWN_FLAGS = 50  # recent steps spelled out in a pathological report

HealthState = Literal["clean", "warm-up", "sporadic", "pathological"]
_STATES: tuple[str, ...] = get_args(HealthState)
_STATE_KEYS = ("state", "steps", "skipped", "warmup_skipped", "consecutive", "scale", "flags")
_RECORD = "a (step, scale, skipped_steps, grad_norm, skipped) tuple of int >= 0, float, int >= 0, float, bool"
_CORRUPT = (
    "the checkpoint's entry is corrupt or from another callback: pass what state_dict() returned, or resume "
    "without the entry (the statistics then start afresh)."
)


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
        self.min_scale = _number_or_none("SkipHealth", "min_scale", min_scale, "pass the scaler's min_scale.")
        self.warmup_steps, self.window = warmup_steps, window
        self.max_consecutive_skips, self.max_skip_rate = max_consecutive_skips, max_skip_rate
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
        """Account for one optimizer step; return a verdict when the state changes, else ``None``.

        Raises:
            TypeError / ValueError: ``skipped`` is not a bool, or ``scale`` is neither ``None`` nor a
                finite number >= 0 (nothing is counted then).
        """
        check_bool("SkipHealth.observe", "skipped", skipped)
        scale = _number_or_none(
            "SkipHealth.observe", "scale", scale, "pass LossScaler.get_scale().", zero=True
        )
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


def validate_policy(
    owner: str, warmup_steps: object, window: object, consecutive: object, rate: object
) -> None:
    """Check :class:`SkipHealth`'s policy arguments, as passed to ``owner``."""
    check_int(
        owner, "warmup_steps", warmup_steps, low=0, hint="100 covers a scale calibrating down from 2**16."
    )
    check_int(owner, "window", window, low=1, hint="200 steps is the default.")
    check_int(owner, "max_consecutive_skips", consecutive, low=1,
              hint="10 is the default; with LossScaler(hysteresis=h) allow well over h.")  # fmt: skip
    check_number(owner, "max_skip_rate", rate, low=0.0, low_open=True, high=1.0,
                 hint="0.05 flags runs that skip over 5% of steps.")  # fmt: skip


def validate_monitor_options(on_pathological: object, trace_nonfinite: object, plot_path: object) -> None:
    """Check ``LossScaleMonitor``'s options other than the policy."""
    call = "LossScaleMonitor"
    check_choice(call, "on_pathological", on_pathological, ("warn", "raise"),
                 "'raise' stops training with the history in the error.")  # fmt: skip
    check_bool(call, "trace_nonfinite", trace_nonfinite)
    if plot_path is not None and not isinstance(plot_path, (str, os.PathLike)):
        fail(
            call, f"plot_path={plot_path!r}", "None or a file path", "pass e.g. 'loss_scale.png'.", TypeError
        )
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            f"LossScaleMonitor(plot_path={str(plot_path)!r}) needs matplotlib, which is not installed. "
            "HINT: pip install 'amp_plugin[examples]' (or pip install matplotlib), or drop plot_path."
        )


def _number_or_none(
    call: str,
    name: str,
    value: object,
    hint: str,
    *,
    zero: bool = False,
    error: type[Exception] | None = None,
) -> float | None:
    """``None`` or a finite number > 0 (>= 0 with ``zero``: a scale halved ~150 times in a row is 0)."""
    if value is None:
        return None
    if not is_number(value) or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        wrong_type = not isinstance(value, (int, float)) or isinstance(value, bool)
        fail(call, f"{name}={value!r}", f"None or a finite number {'>=' if zero else '>'} 0", hint,
             error or (TypeError if wrong_type else ValueError))  # fmt: skip
    return float(value)  # type: ignore[arg-type]


# -- checkpoints: everything is checked before anything is applied ------------------------------


def _listed(names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _check_dict(state: object, call: str, where: str, source: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(state, dict):
        got = f"{where}={state!r:.80}" if where else f"state_dict={type(state).__name__}"
        fail(call, got, f"the dict from {source}", _CORRUPT, ValueError if where else TypeError)
    missing = tuple(k for k in keys if k not in state)
    if missing:
        allowed = f"the dict from {source}, with {_listed(keys)} (missing {_listed(missing)})"
        fail(call, f"{where or 'state_dict'} with keys {sorted(map(str, state))}", allowed, _CORRUPT)
    return state


class _Entries:
    """Reads a state dict's entries; a bad one raises, naming it, with the project's message."""

    def __init__(self, state: dict[str, Any], call: str, where: str) -> None:
        self.state, self.call, self.where = state, call, where

    def bad(self, key: str, allowed: str) -> NoReturn:
        name = f"{self.where}[{key!r}]" if self.where else key
        fail(self.call, f"{name}={self.state[key]!r:.80}", allowed, _CORRUPT)

    def count(self, key: str, high: int | None = None, of: str = "") -> int:
        value = self.state[key]
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not 0 <= value <= (value if high is None else high)
        ):
            self.bad(key, "an int >= 0" if high is None else f"an int from 0 to {of}={high}")
        return value

    def flags(self, steps: int, skipped: int) -> list[bool]:
        flags = self.state["flags"]
        ok = isinstance(flags, (list, tuple)) and all(isinstance(f, bool) for f in flags)
        if not ok or len(flags) > steps or sum(flags) > skipped:
            self.bad(
                "flags", f"a list of bools, at most steps={steps} long, with at most skipped={skipped} True"
            )
        return list(flags)


def check_health_state(state: object, call: str, where: str = "") -> dict[str, Any]:
    """Check a :meth:`SkipHealth.state_dict` in full and return its values; nothing is applied.

    ``where`` names the entry inside a larger state dict (``"health"`` in the monitor's).
    """
    entries = _Entries(_check_dict(state, call, where, "SkipHealth.state_dict()", _STATE_KEYS), call, where)
    values = entries.state
    if not isinstance(values["state"], str) or values["state"] not in _STATES:
        entries.bad("state", "one of " + ", ".join(map(repr, _STATES)))
    steps = entries.count("steps")
    skipped = entries.count("skipped", steps, "steps")
    warmup_skipped = entries.count("warmup_skipped", skipped, "skipped")
    consecutive = entries.count("consecutive", skipped, "skipped")
    scale_name = f"{where}['scale']" if where else "scale"
    scale = _number_or_none(call, scale_name, values["scale"], _CORRUPT, zero=True, error=ValueError)
    flags = entries.flags(steps, skipped)
    ending = next((i for i, f in enumerate(reversed(flags)) if not f), len(flags))  # skips that end flags
    if ending < len(flags) and consecutive != ending:
        entries.bad("consecutive", f"the number of skipped steps that end flags ({ending})")
    if ending == len(flags) and consecutive < ending:
        entries.bad("consecutive", f"at least {ending}: every one of the flags is a skipped step")
    return {
        "state": values["state"], "steps": steps, "skipped": skipped, "warmup_skipped": warmup_skipped,
        "consecutive": consecutive, "scale": scale, "flags": flags,
    }  # fmt: skip


def check_records(records: object, call: str) -> list[ScaleRecord]:
    """Check the monitor's saved history (tuples, or lists after JSON); return it as records."""
    if not isinstance(records, (list, tuple)):
        fail(call, f"records={records!r:.80}", f"a list of {_RECORD}s", _CORRUPT)

    def real(x: object) -> bool:  # NaN is "unknown" and inf an overflowing norm: both are records
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def counts(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    checked = []
    for i, r in enumerate(records):
        ok = isinstance(r, (tuple, list)) and len(r) == len(ScaleRecord._fields)
        if not (
            ok and counts(r[0]) and real(r[1]) and counts(r[2]) and real(r[3]) and isinstance(r[4], bool)
        ):
            fail(call, f"records[{i}]={tuple(r) if isinstance(r, list) else r!r:.80}", _RECORD, _CORRUPT)
        checked.append(ScaleRecord(r[0], float(r[1]), r[2], float(r[3]), r[4]))
    return checked


def check_monitor_state(state: object) -> tuple[dict[str, Any], list[ScaleRecord]]:
    """Check ``LossScaleMonitor.state_dict()`` in full; return the health state and the records."""
    call = "LossScaleMonitor.load_state_dict"
    checked = _check_dict(state, call, "", "LossScaleMonitor.state_dict()", ("health", "records"))
    return check_health_state(checked["health"], call, "health"), check_records(checked["records"], call)
