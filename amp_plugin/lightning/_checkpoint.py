"""Where ``AMPPrecision`` keeps its run's state in a Lightning checkpoint, and how it reads it back.

The entry sits under :data:`CHECKPOINT_KEY`, not under the plugin's class name as Lightning would
file a non-empty ``Precision.state_dict``: a rename or a subclass would orphan that. It holds the
precision and :meth:`AMPRun.state_dict <amp_plugin._run.AMPRun.state_dict>` with the scaler's part
under ``"scaler"``; the run checks and loads it (:meth:`~amp_plugin._run.AMPRun.load_state_dict`).
A checkpoint written by Lightning's ``MixedPrecision`` (under its class name, or the pre-2.0
``native_amp_scaling_state``) loads too; and the other way round, an fp16 run also writes its
scale where Lightning's ``MixedPrecision`` reads it (its class name), in ``GradScaler``'s five
keys, so going back to Lightning resumes the scale.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from amp_plugin import _run as run_state
from amp_plugin._run import STATE_EXTRAS, AMPRun
from amp_plugin._scaler import LossScaler

__all__ = [
    "CHECKPOINT_KEY",
    "checkpoint_entry",
    "grad_scaler_state",
    "load_scaler_state",
    "run_state_of",
    "save",
    "scaler_state",
]

CHECKPOINT_KEY = "amp_plugin"
"""The checkpoint key of ``AMPPrecision``'s entry: its precision, the scaler state, the rounding state."""
# Where Lightning's MixedPrecision keeps its GradScaler state: its class name, and the pre-2.0 key.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")
# What torch.amp.GradScaler.load_state_dict reads (our scaler's state holds them, with the same meaning).
_GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def checkpoint_entry(precision: str, state: dict[str, Any]) -> dict[str, Any]:
    """What ``AMPPrecision`` saves under :data:`CHECKPOINT_KEY`: its precision and its run's ``state``.

    ``state`` is :meth:`AMPRun.state_dict <amp_plugin._run.AMPRun.state_dict>`'s: the scaler's
    keys go under ``"scaler"``, the guard's and the rounding's state beside it.

    Example:
        >>> entry = checkpoint_entry("16-mixed", LossScaler("cpu", init_scale=8.0).state_dict())
        >>> entry["precision"], entry["scaler"]["scale"]
        ('16-mixed', 8.0)
        >>> checkpoint_entry("bf16-mixed", {})
        {'precision': 'bf16-mixed', 'scaler': {}}
    """
    entry = {"precision": precision, "scaler": {k: v for k, v in state.items() if k not in STATE_EXTRAS}}
    entry.update((key, state[key]) for key in STATE_EXTRAS if key in state)
    return entry


def grad_scaler_state(state: dict[str, Any]) -> dict[str, Any]:
    """The part of a scaler ``state`` a ``torch.amp.GradScaler`` loads: its five keys (empty without them).

    What Lightning's own plugins restore their scaler from, so that going back to them keeps the scale.

    Example:
        >>> sorted(grad_scaler_state(LossScaler("cpu", init_scale=8.0, hysteresis=2).state_dict()))
        ['_growth_tracker', 'backoff_factor', 'growth_factor', 'growth_interval', 'scale']
        >>> grad_scaler_state({"guard": {}})
        {}
    """
    if not all(key in state for key in _GRAD_SCALER_KEYS):
        return {}
    return {key: state[key] for key in _GRAD_SCALER_KEYS}


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


def run_state_of(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The run's state in a checkpoint, as :meth:`AMPRun.state_dict <amp_plugin._run.AMPRun.state_dict>`
    gives it (ours, or the ``GradScaler`` state of Lightning's ``MixedPrecision``); ``None`` if it has none.

    Raises:
        ValueError: the entry under :data:`CHECKPOINT_KEY` is not a dict with a dict ``"scaler"``.

    Example:
        >>> run_state_of({CHECKPOINT_KEY: {"precision": "bf16-mixed", "scaler": {}, "guard": {"a": 1}}})
        {'guard': {'a': 1}}
        >>> run_state_of({"MixedPrecision": {"scale": 4.0}}), run_state_of({})
        ({'scale': 4.0}, None)
    """
    state = scaler_state(checkpoint)
    if state is None:
        return None
    entry = checkpoint.get(CHECKPOINT_KEY)
    extras = {key: entry[key] for key in STATE_EXTRAS if key in entry} if isinstance(entry, dict) else {}
    return {**state, **extras}


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


def save(checkpoint: dict[str, Any], run: AMPRun) -> None:
    """Write the run's entry; with a loss scaler, its ``GradScaler`` part also under ``"MixedPrecision"``.

    That is the key Lightning's ``MixedPrecision`` restores its ``GradScaler`` from (this plugin
    reads its own entry first).

    Example:
        >>> checkpoint = {}
        >>> save(checkpoint, AMPRun("bf16-mixed", "cpu"))
        >>> sorted(checkpoint), sorted(checkpoint[CHECKPOINT_KEY])
        (['amp_plugin'], ['guard', 'precision', 'scaler'])
        >>> save(checkpoint, AMPRun("16-mixed", "cpu", LossScaler("cpu", init_scale=8.0)))
        >>> checkpoint["MixedPrecision"]["scale"], sorted(checkpoint["MixedPrecision"])
        (8.0, ['_growth_tracker', 'backoff_factor', 'growth_factor', 'growth_interval', 'scale'])
    """
    state = run.state_dict()
    checkpoint[CHECKPOINT_KEY] = checkpoint_entry(run.precision, state)
    if run.scaler is not None and (theirs := grad_scaler_state(state)):
        checkpoint[_FOREIGN_KEYS[0]] = theirs  # Lightning's MixedPrecision resumes the scale from here
