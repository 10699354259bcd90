"""Checkpoint helpers and AMPPrecision's checkpoint hooks, without a Trainer.fit."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.lightning import CHECKPOINT_KEY
from amp_plugin.lightning._checkpoint import checkpoint_entry, load_scaler_state, run_state_of, scaler_state


def test_check_checkpoint_accepts_what_loads() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    good = LossScaler(init_scale=8.0).state_dict()
    for checkpoint in (
        {CHECKPOINT_KEY: {"precision": "16-mixed", "scaler": good}},
        {"MixedPrecision": good},
        {},
    ):
        plugin.check_checkpoint(checkpoint)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**16  # checking loads nothing


def test_legacy_native_amp_key_loads() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    plugin.on_load_checkpoint(
        {"native_amp_scaling_state": torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()}
    )
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "entry",
    [
        {"scaler": {"scale": 2.0}},
        "garbage",
        {"no_scaler": 1},
        {"scaler": {**LossScaler().state_dict(), "x": 1}},
    ],
)
def test_corrupt_checkpoint_entry_raises_and_changes_nothing(entry: Any) -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=4.0))
    assert plugin.scaler is not None
    before = copy.deepcopy(plugin.scaler.state_dict())
    with pytest.raises(ValueError, match="HINT"):
        plugin.on_load_checkpoint({CHECKPOINT_KEY: entry})
    assert plugin.scaler.state_dict() == before


def test_the_entry_holds_the_precision_and_the_scaler_state() -> None:
    scaler = LossScaler("cpu", init_scale=8.0)
    assert checkpoint_entry("16-mixed", scaler.state_dict()) == {
        "precision": "16-mixed",
        "scaler": scaler.state_dict(),
    }
    assert checkpoint_entry("bf16-mixed", {}) == {"precision": "bf16-mixed", "scaler": {}}
    guard, rounding = {"skipped_steps": 1}, [{"generator": 1}]
    entry = checkpoint_entry("bf16-true", {"guard": guard, "rounding": rounding})
    assert entry == {"precision": "bf16-true", "scaler": {}, "guard": guard, "rounding": rounding}
    assert run_state_of({CHECKPOINT_KEY: entry}) == {"guard": guard, "rounding": rounding}  # the run's own


def test_saved_entry_round_trips_through_the_hooks() -> None:
    saved: dict[str, Any] = {}
    AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=8.0)).on_save_checkpoint(saved)
    assert saved[CHECKPOINT_KEY]["precision"] == "16-mixed"
    plugin = AMPPrecision("16-mixed", device="cpu")
    plugin.on_load_checkpoint(saved)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 8.0
    assert plugin.state_dict() == {}  # nothing under the class name, where a rename would orphan it


def test_our_entry_wins_over_lightnings_and_mixed_precision_over_the_legacy_key() -> None:
    ours, theirs, legacy = {"scale": 1.0}, {"scale": 2.0}, {"scale": 3.0}
    everything = {
        CHECKPOINT_KEY: {"scaler": ours},
        "MixedPrecision": theirs,
        "native_amp_scaling_state": legacy,
    }
    assert scaler_state(everything) is ours
    del everything[CHECKPOINT_KEY]
    assert scaler_state(everything) is theirs
    del everything["MixedPrecision"]
    assert scaler_state(everything) is legacy
    assert scaler_state({"state_dict": {}}) is None


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (["not", "a", "dict"], r"'amp_plugin' entry is list \['not', 'a', 'dict'\]; expected a dict"),
        ({"precision": "16-mixed"}, r"'amp_plugin' entry is dict .*; expected a dict whose 'scaler'"),
        ({"scaler": "garbage"}, r"'amp_plugin' entry is dict .*HINT: the checkpoint is corrupt"),
    ],
)
def test_a_malformed_entry_is_refused(entry: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        scaler_state({CHECKPOINT_KEY: entry})


def test_checking_without_a_scaler_accepts_any_well_formed_scaler_state() -> None:
    # (A disabled scaler cannot get here: the plugin refuses one, see tests/integration/test_guard.py.)
    bad_state = {CHECKPOINT_KEY: {"scaler": {"scale": "nan"}}}
    AMPPrecision("bf16-mixed", device="cpu").check_checkpoint(bad_state)
    with pytest.raises(ValueError, match="HINT"):
        AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu")).check_checkpoint(bad_state)


@pytest.mark.parametrize(
    ("scaler", "state", "said"),
    [
        (LossScaler("cpu"), {}, "holds no loss-scaler state (a bf16 run?); the scale starts afresh"),
        (None, LossScaler("cpu").state_dict(), "but this bf16 run has no scaler: ignored"),
        (None, {}, None),
    ],
)
def test_loading_warns_when_only_one_side_has_a_state(
    scaler: LossScaler | None, state: dict[str, Any], said: str | None
) -> None:
    before = None if scaler is None else scaler.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_scaler_state(scaler, state)
    messages = [str(w.message) for w in caught]
    assert len(messages) == (0 if said is None else 1), messages
    assert said is None or said in messages[0]
    assert scaler is None or scaler.state_dict() == before


def test_the_load_warning_points_at_the_plugin() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    with pytest.warns(UserWarning, match="holds no loss-scaler state") as caught:
        plugin.load_state_dict({})
    # The plugin's load_state_dict, not the helper it calls or Lightning.
    lines, start = inspect.getsourcelines(AMPPrecision.load_state_dict)
    assert caught[0].filename == inspect.getsourcefile(AMPPrecision)
    assert start <= caught[0].lineno < start + len(lines)


def test_check_checkpoint_of_what_is_not_a_checkpoint_is_refused_with_a_hint() -> None:
    with pytest.raises(TypeError, match=r"^AMPPrecision.check_checkpoint\(checkpoint=int\).*HINT"):
        AMPPrecision("16-mixed", device="cpu").check_checkpoint(3)  # type: ignore[arg-type]
