"""What the run-health statistics save, and the checks that run before any of it is loaded.

:class:`ScaleRecord` is one sample of the monitor's history; :func:`check_health_state` checks a
``SkipHealth.state_dict()`` and :func:`check_monitor_state` a ``LossScaleMonitor.state_dict()``,
in full, so that a corrupt or foreign checkpoint entry changes nothing. Plain Python.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, NoReturn, get_args

from amp_plugin._validation import fail, is_number

__all__ = [
    "HealthState",
    "ScaleRecord",
    "check_health_state",
    "check_monitor_state",
    "check_records",
    "number_or_none",
]

HealthState = Literal["clean", "warm-up", "sporadic", "pathological"]
_STATES: tuple[str, ...] = get_args(HealthState)
_STATE_KEYS = ("state", "steps", "skipped", "warmup_skipped", "consecutive", "scale", "flags")
_RECORD = "a (step, scale, skipped_steps, grad_norm, skipped) tuple of int >= 0, float, int >= 0, float, bool"
_CORRUPT = (
    "the checkpoint's entry is corrupt or from another callback: pass what state_dict() returned, or resume "
    "without the entry (the statistics then start afresh)."
)


class ScaleRecord(NamedTuple):
    """One sample of the run, taken on logged and on skipped steps.

    ``step`` counts optimizer steps done (``trainer.global_step``); ``scale`` and ``grad_norm``
    are NaN where unknown (bf16 has no scale; the norm exists on logged steps).

    Example:
        >>> ScaleRecord(step=10, scale=1024.0, skipped_steps=2, grad_norm=0.5, skipped=False).scale
        1024.0
    """

    step: int
    scale: float
    skipped_steps: int
    grad_norm: float
    skipped: bool


def number_or_none(
    call: str,
    name: str,
    value: object,
    hint: str,
    *,
    zero: bool = False,
    error: type[Exception] | None = None,
) -> float | None:
    """``None`` or a finite number > 0 (>= 0 with ``zero``: a scale halved ~150 times in a row is 0).

    ``error`` overrides the exception type (``TypeError`` for a non-number, else ``ValueError``).

    Example:
        >>> number_or_none("SkipHealth", "min_scale", 1, "pass the scaler's min_scale.")
        1.0
    """
    if value is None:
        return None
    if not is_number(value) or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        wrong_type = not isinstance(value, (int, float)) or isinstance(value, bool)
        fail(
            call,
            passed=f"{name}={value!r}",
            why="it is not a number" if wrong_type else "it is out of range",
            allowed=f"None or a finite number {'>=' if zero else '>'} 0",
            hint=hint,
            error=error or (TypeError if wrong_type else ValueError),
        )
    return float(value)  # type: ignore[arg-type]


# -- checkpoints: everything is checked before anything is applied ------------------------------


def _listed(names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _check_dict(state: object, call: str, where: str, source: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(state, dict):
        got = f"{where}={state!r:.80}" if where else f"state_dict={type(state).__name__}"
        fail(
            call,
            passed=got,
            why="it is not a dict",
            allowed=f"the dict from {source}",
            hint=_CORRUPT,
            error=ValueError if where else TypeError,
        )
    missing = tuple(k for k in keys if k not in state)
    if missing:
        allowed = f"the dict from {source}, with {_listed(keys)} (missing {_listed(missing)})"
        fail(
            call,
            passed=f"{where or 'state_dict'} with keys {sorted(map(str, state))}",
            why=f"{_listed(missing)} missing",
            allowed=allowed,
            hint=_CORRUPT,
        )
    return state


class _Entries:
    """Reads a state dict's entries; a bad one raises, naming it, with the project's message."""

    def __init__(self, state: dict[str, Any], call: str, where: str) -> None:
        self.state, self.call, self.where = state, call, where

    def bad(self, key: str, allowed: str) -> NoReturn:
        name = f"{self.where}[{key!r}]" if self.where else key
        fail(
            self.call,
            passed=f"{name}={self.state[key]!r:.80}",
            why="the saved value cannot come from this object",
            allowed=allowed,
            hint=_CORRUPT,
        )

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
    """Check a ``SkipHealth.state_dict()`` in full and return its values; nothing is applied.

    ``where`` names the entry inside a larger state dict (``"health"`` in the monitor's).

    Raises:
        TypeError: ``state`` is not a dict (``ValueError`` when ``where`` names an entry).
        ValueError: an entry is missing, of the wrong type, or contradicts another.

    Example:
        >>> saved = {"state": "warm-up", "steps": 2, "skipped": 1, "warmup_skipped": 1, "consecutive": 0,
        ...          "scale": 1024.0, "flags": [True, False]}
        >>> check_health_state(saved, "SkipHealth.load_state_dict")["skipped"]
        1
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
    scale = number_or_none(call, scale_name, values["scale"], _CORRUPT, zero=True, error=ValueError)
    flags = entries.flags(steps, skipped)
    ending = next((i for i, f in enumerate(reversed(flags)) if not f), len(flags))  # skips that end flags
    if ending < len(flags) and consecutive != ending:
        entries.bad("consecutive", f"the number of skipped steps that end flags ({ending})")
    if ending == len(flags) and consecutive < ending:
        entries.bad("consecutive", f"at least {ending}: every one of the flags is a skipped step")
    return {
        "state": values["state"],
        "steps": steps,
        "skipped": skipped,
        "warmup_skipped": warmup_skipped,
        "consecutive": consecutive,
        "scale": scale,
        "flags": flags,
    }


def check_records(records: object, call: str) -> list[ScaleRecord]:
    """Check the monitor's saved history (tuples, or lists after JSON); return it as records.

    Raises:
        ValueError: ``records`` is not a list of records, or a record is malformed (named by index).

    Example:
        >>> check_records([[3, 512.0, 1, 0.25, True]], "load")
        [ScaleRecord(step=3, scale=512.0, skipped_steps=1, grad_norm=0.25, skipped=True)]
    """
    if not isinstance(records, (list, tuple)):
        fail(
            call,
            passed=f"records={records!r:.80}",
            why="the saved records are not a list",
            allowed=f"a list of {_RECORD}s",
            hint=_CORRUPT,
        )

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
            fail(
                call,
                passed=f"records[{i}]={tuple(r) if isinstance(r, list) else r!r:.80}",
                why="the saved record is malformed",
                allowed=_RECORD,
                hint=_CORRUPT,
            )
        checked.append(ScaleRecord(r[0], float(r[1]), r[2], float(r[3]), r[4]))
    return checked


def check_monitor_state(state: object) -> tuple[dict[str, Any], list[ScaleRecord]]:
    """Check ``LossScaleMonitor.state_dict()`` in full; return the health state and the records.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: ``"health"`` or ``"records"`` is missing or malformed.

    Example:
        >>> from amp_plugin.diagnostics._health import SkipHealth
        >>> health, records = check_monitor_state({"health": SkipHealth().state_dict(), "records": []})
        >>> health["steps"], records
        (0, [])
    """
    call = "LossScaleMonitor.load_state_dict"
    checked = _check_dict(state, call, "", "LossScaleMonitor.state_dict()", ("health", "records"))
    return check_health_state(checked["health"], call, "health"), check_records(checked["records"], call)
