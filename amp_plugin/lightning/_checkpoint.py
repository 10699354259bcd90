"""Where ``AMPPrecision`` keeps the loss-scaler state in a Lightning checkpoint, and how it reads it back.

The entry sits under :data:`CHECKPOINT_KEY`, not under the plugin's class name as Lightning would
file a non-empty ``Precision.state_dict``: a rename or a subclass would orphan that. A checkpoint
written by Lightning's ``MixedPrecision`` (under its class name, or the pre-2.0
``native_amp_scaling_state``) loads too; and the other way round, an fp16 run also writes its
scale where Lightning's ``MixedPrecision`` reads it (its class name), in ``GradScaler``'s five
keys, so going back to Lightning resumes the scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

from amp_plugin import _run as run_state
from amp_plugin._scaler import LossScaler

if TYPE_CHECKING:
    from amp_plugin._half_weights import HalfWeights

__all__ = [
    "CHECKPOINT_KEY",
    "check_entry",
    "check_scaler_state",
    "checkpoint_entry",
    "grad_scaler_state",
    "load_entry",
    "load_scaler_state",
    "save_entry",
    "scaler_state",
]

CHECKPOINT_KEY = "amp_plugin"
"""The checkpoint key of ``AMPPrecision``'s entry: its precision, the scaler state, the rounding state."""
# Where Lightning's MixedPrecision keeps its GradScaler state: its class name, and the pre-2.0 key.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")
# What torch.amp.GradScaler.load_state_dict reads (our scaler's state holds them, with the same meaning).
_GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def checkpoint_entry(precision: str, scaler: LossScaler | None) -> dict[str, Any]:
    """What ``AMPPrecision`` saves under :data:`CHECKPOINT_KEY`: its precision and the scaler's state.

    Example:
        >>> entry = checkpoint_entry("16-mixed", LossScaler("cpu", init_scale=8.0))
        >>> entry["precision"], entry["scaler"]["scale"]
        ('16-mixed', 8.0)
        >>> checkpoint_entry("bf16-mixed", None)
        {'precision': 'bf16-mixed', 'scaler': {}}
    """
    return {"precision": precision, "scaler": scaler.state_dict() if scaler is not None else {}}


def grad_scaler_state(scaler: LossScaler) -> dict[str, Any]:
    """The part of ``scaler``'s state a ``torch.amp.GradScaler`` loads: its five keys (empty if disabled).

    What Lightning's own plugins restore their scaler from, so that going back to them keeps the scale.

    Example:
        >>> sorted(grad_scaler_state(LossScaler("cpu", init_scale=8.0, hysteresis=2)))
        ['_growth_tracker', 'backoff_factor', 'growth_factor', 'growth_interval', 'scale']
    """
    state = scaler.state_dict()
    return {key: state[key] for key in _GRAD_SCALER_KEYS} if state else {}


def scaler_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The loss-scaler state in a checkpoint (ours, or MixedPrecision's), ``None`` if it has none.

    Raises:
        ValueError: the entry under :data:`CHECKPOINT_KEY` is not a dict with a dict ``"scaler"``.

    Example:
        >>> scaler_state({CHECKPOINT_KEY: {"precision": "16-mixed", "scaler": {"scale": 8.0}}})
        {'scale': 8.0}
        >>> scaler_state({"MixedPrecision": {"scale": 4.0}}), scaler_state({})
        ({'scale': 4.0}, None)
    """
    entry = checkpoint.get(CHECKPOINT_KEY)
    if entry is None:
        entry = next(({"scaler": checkpoint[key]} for key in _FOREIGN_KEYS if key in checkpoint), None)
        if entry is None:
            return None
    if not isinstance(entry, dict) or not isinstance(entry.get("scaler"), dict):
        raise ValueError(
            f"The checkpoint's {CHECKPOINT_KEY!r} entry is {type(entry).__name__} {entry!r:.80}; "
            "expected a dict whose 'scaler' is a loss-scaler state dict. HINT: the checkpoint is corrupt "
            "or was written by another program; resume without ckpt_path or fix the entry."
        )
    return entry["scaler"]  # type: ignore[no-any-return]


def check_scaler_state(checkpoint: dict[str, Any], scaler: LossScaler | None) -> None:
    """Raise ``ValueError`` if the checkpoint's scaler state would not load into ``scaler``; change nothing.

    Example:
        >>> scaler = LossScaler("cpu")
        >>> check_scaler_state({CHECKPOINT_KEY: {"scaler": LossScaler("cpu").state_dict()}}, scaler)
        >>> check_scaler_state({CHECKPOINT_KEY: ["not", "a", "dict"]}, scaler)
        Traceback (most recent call last):
        ...
        ValueError: The checkpoint's 'amp_plugin' entry is list ['not', 'a', 'dict']; ... HINT: ...
    """
    state = scaler_state(checkpoint)
    if state and scaler is not None and scaler.is_enabled():
        scaler.check_state_dict(state)


def load_scaler_state(scaler: LossScaler | None, state_dict: dict[str, Any]) -> None:
    """Load a scaler state (from ``AMPPrecision``, ``LossScaler`` or ``torch.amp.GradScaler``).

    Warns instead when only one side has a state: a bf16 run has no scaler, a bf16 checkpoint no state.

    Example:
        >>> scaler = LossScaler("cpu")
        >>> load_scaler_state(scaler, LossScaler("cpu", init_scale=8.0).state_dict())
        >>> scaler.get_scale()
        8.0
    """
    note = run_state.load_scaler_state(scaler, state_dict)
    if note is not None:  # stacklevel=5: the warning names the caller's line, not this helper's
        rank_zero_warn(note, stacklevel=5)


def save_entry(
    checkpoint: dict[str, Any],
    precision: str,
    scaler: LossScaler | None,
    guard: LossScaler | None,
    half: HalfWeights | None,
) -> None:
    """Write the plugin's entry: precision, the scaler state (or a bf16/fp32 guard's), the half weights'.

    With a loss scaler, its ``GradScaler`` part also goes under ``"MixedPrecision"``, the key
    Lightning's ``MixedPrecision`` restores its ``GradScaler`` from (this plugin reads its own
    entry first).

    Example:
        >>> checkpoint = {}
        >>> save_entry(checkpoint, "bf16-mixed", None, LossScaler("cpu", init_scale=1.0, dynamic=False), None)
        >>> sorted(checkpoint), sorted(checkpoint[CHECKPOINT_KEY])
        (['amp_plugin'], ['guard', 'precision', 'scaler'])
        >>> save_entry(checkpoint, "16-mixed", LossScaler("cpu", init_scale=8.0), None, None)
        >>> checkpoint["MixedPrecision"]["scale"], sorted(checkpoint["MixedPrecision"])
        (8.0, ['_growth_tracker', 'backoff_factor', 'growth_factor', 'growth_interval', 'scale'])
    """
    entry = checkpoint_entry(precision, scaler)
    if scaler is None and guard is not None:  # bf16/fp32: the guard's skip counts resume too
        entry["guard"] = guard.state_dict()
    checkpoint[CHECKPOINT_KEY] = entry
    if scaler is not None and entry["scaler"]:  # Lightning's MixedPrecision resumes the scale from here
        checkpoint[_FOREIGN_KEYS[0]] = grad_scaler_state(scaler)
    if half is not None:
        half.on_save(checkpoint, entry)


def check_entry(
    checkpoint: dict[str, Any], scaler: LossScaler | None, guard: LossScaler | None, half: HalfWeights | None
) -> None:
    """Raise ``ValueError`` if any part of the plugin's entry would not load; change nothing.

    Example:
        >>> check_entry({CHECKPOINT_KEY: {"scaler": 3}}, LossScaler("cpu"), None, None)
        Traceback (most recent call last):
        ...
        ValueError: The checkpoint's 'amp_plugin' entry is dict ...; ... HINT: ...
    """
    check_scaler_state(checkpoint, scaler)
    guard_state = _guard_state(checkpoint, scaler, guard)
    if guard_state is not None and guard is not None:
        guard.check_state_dict(guard_state)
    if half is not None:
        half.check(checkpoint, checkpoint.get(CHECKPOINT_KEY))


def load_entry(
    checkpoint: dict[str, Any], scaler: LossScaler | None, guard: LossScaler | None, half: HalfWeights | None
) -> None:
    """Check the whole entry (:func:`check_entry`), then load the half weights', the scaler's, the guard's.

    Example:
        >>> scaler = LossScaler("cpu")
        >>> checkpoint = {}
        >>> save_entry(checkpoint, "16-mixed", LossScaler("cpu", init_scale=8.0), None, None)
        >>> load_entry(checkpoint, scaler, scaler, None)
        >>> scaler.get_scale()
        8.0
    """
    check_entry(checkpoint, scaler, guard, half)
    if half is not None:
        half.on_load(checkpoint, checkpoint.get(CHECKPOINT_KEY))
    state = scaler_state(checkpoint)
    if state is not None:
        load_scaler_state(scaler, state)
    guard_state = _guard_state(checkpoint, scaler, guard)
    if guard_state is not None and guard is not None:
        guard.load_state_dict(guard_state)


def _guard_state(
    checkpoint: dict[str, Any], scaler: LossScaler | None, guard: LossScaler | None
) -> dict[str, Any] | None:
    """The bf16/fp32 guard's state in the checkpoint, where this run has a guard and no scaler."""
    entry = checkpoint.get(CHECKPOINT_KEY)
    if scaler is not None or guard is None or not isinstance(entry, dict):
        return None
    state = entry.get("guard")
    return state if isinstance(state, dict) and state else None
