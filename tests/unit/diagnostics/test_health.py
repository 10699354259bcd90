"""Tests for ``amp_plugin.diagnostics._health`` and ``health_state``: SkipHealth on scripted histories."""

from __future__ import annotations

from typing import Any

import pytest

from amp_plugin.diagnostics._health import SkipHealth


def _run(health: SkipHealth, flags: str, scales: dict[int, float] | None = None) -> list[tuple[int, str]]:
    """Feed 'x' (skipped) / '.' (stepped) flags; return the (step, state) of every change."""
    scales = scales or {}
    changes = []
    for i, flag in enumerate(flags, start=1):
        verdict = health.observe(flag == "x", scales.get(i))
        if verdict is not None:
            changes.append((verdict.step, verdict.state))
    return changes


def _health(**kwargs: Any) -> SkipHealth:
    policy = {"warmup_steps": 5, "window": 10, "max_consecutive_skips": 3, "max_skip_rate": 0.25}
    return SkipHealth(**{**policy, **kwargs})


def test_warm_up_skips_are_normal_and_end_with_warm_up() -> None:
    health = _health()
    assert _run(health, "xxxx." + "." * 20) == [(1, "warm-up"), (6, "clean")]
    assert (health.skipped, health.warmup_skipped, health.consecutive) == (4, 4, 0)


def test_rare_skips_after_warm_up_are_sporadic() -> None:
    health = _health()
    assert _run(health, "." * 8 + "x" + "." * 9 + "x" + "." * 10) == [(9, "sporadic")]
    assert health.skip_rate == pytest.approx(0.0)


def test_consecutive_skips_are_pathological_then_recover() -> None:
    health = _health(window=100)
    changes = _run(health, "." * 6 + "xxx" + "....")
    assert changes == [(7, "sporadic"), (9, "pathological"), (10, "sporadic")]


def test_a_skip_run_from_warm_up_is_judged_when_warm_up_ends() -> None:
    # Calibration may skip every warm-up step; still skipping after it is not calibration any more.
    assert _run(_health(max_consecutive_skips=6), "xxxxx" + "x") == [(1, "warm-up"), (6, "pathological")]


def test_skip_rate_over_a_full_window_after_warm_up() -> None:
    health = _health(max_consecutive_skips=100)
    flags = "....." + "x..x..x..x"  # 40% of the window, but not pathological before the window is full
    assert _run(health, flags) == [(6, "sporadic"), (15, "pathological")]
    assert health.skip_rate == pytest.approx(0.4)


def test_scale_at_min_scale_is_pathological_until_it_rises() -> None:
    health = _health(min_scale=1.0)
    changes = _run(health, "." * 6 + "x" + "...", scales={7: 1.0, 10: 2.0})
    assert changes == [(7, "pathological"), (10, "sporadic")]
    assert health.observe(False, 1.0000001) is not None  # float32 rounding of min_scale still counts


def test_a_scale_below_one_is_pathological_even_in_warm_up() -> None:
    # Overflow without any scaling is not calibration: no need to wait for warm-up to end.
    changes = _run(_health(warmup_steps=100), "x" * 12, scales={i: 2.0 ** (10 - i) for i in range(1, 13)})
    assert changes == [(1, "warm-up"), (11, "pathological")]
    floored = _health(warmup_steps=100, min_scale=0.25)  # an explicit floor below 1 is the user's call
    assert _run(floored, "x" * 11, scales={i: 2.0 ** (10 - i) for i in range(1, 12)}) == [(1, "warm-up")]


def test_verdicts_say_why() -> None:
    health = _health()
    verdicts = [health.observe(f) for f in [True] + [False] * 6 + [True] * 3]
    reasons = [v.reason for v in verdicts if v is not None]
    assert "calibrates" in reasons[0] and "warm-up is over: 1 steps" in reasons[1]
    assert "rare skips are normal" in reasons[2]
    assert "3 steps in a row were skipped (limit 3)" in reasons[3]


def test_state_dict_round_trip_continues_the_same_way() -> None:
    flags = "x....." + "x.x"
    whole, first = _health(), _health()
    _run(whole, flags + "xx.")
    _run(first, flags)
    resumed = _health()
    resumed.load_state_dict(first.state_dict())
    assert _run(resumed, "xx.") == [(11, "pathological"), (12, "sporadic")]
    assert resumed.state_dict() == whole.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": 1.5}, TypeError, r"warmup_steps=1.5\) is not allowed here: .*an int >= 0"),
        ({"warmup_steps": "10"}, TypeError, r"warmup_steps='10'\) is not allowed here: .*an int >= 0"),
        ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1\) is not allowed here: .*an int >= 0"),
        ({"window": -3}, ValueError, r"window=-3\) is not allowed here: .*an int >= 1"),
        ({"window": 0}, ValueError, r"window=0\) is not allowed here: .*an int >= 1"),
        ({"max_consecutive_skips": 0}, ValueError, r"max_consecutive_skips=0\) is not allowed here: "
            r".*an int >= 1"),
        ({"max_consecutive_skips": True}, TypeError, r"max_consecutive_skips=True\) is not allowed here: "
            r".*an int"),
        ({"max_skip_rate": 0}, ValueError, r"max_skip_rate=0\) is not allowed here: "
            r".*a finite number > 0 and <= 1"),
        ({"max_skip_rate": 1.5}, ValueError, r"max_skip_rate=1.5\) is not allowed here: "
            r".*a finite number > 0"),
        ({"max_skip_rate": float("nan")}, ValueError, r"max_skip_rate=nan\) is not allowed"),
        ({"max_skip_rate": False}, TypeError, r"max_skip_rate=False\) is not allowed"),
        ({"max_skip_rate": "0.05"}, TypeError, r"max_skip_rate='0.05'\) is not allowed"),
        ({"min_scale": 0.0}, ValueError, r"min_scale=0.0\) is not allowed here: "
            r".*None or a finite number > 0"),
        ({"min_scale": "1"}, TypeError, r"min_scale='1'\) is not allowed here: "
            r".*None or a finite number > 0"),
    ],
)
def test_bad_policy_raises(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=r"^SkipHealth\(" + match + r".*HINT"):
        SkipHealth(**kwargs)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("False",), TypeError, r"skipped='False'\) is not allowed here: .*a bool"),
        ((1,), TypeError, r"skipped=1\) is not allowed here: .*a bool"),
        ((True, "512"), TypeError, r"scale='512'\) is not allowed here: .*None or a finite number >= 0"),
        ((True, float("nan")), ValueError, r"scale=nan\) is not allowed here: "
            r".*None or a finite number >= 0"),
        ((True, -2.0), ValueError, r"scale=-2.0\) is not allowed"),
    ],
)
def test_observe_refuses_bad_input_and_counts_nothing(
    args: tuple[Any, ...], error: type[Exception], match: str
) -> None:
    health = _health()
    _run(health, "x..")
    before = health.state_dict()
    with pytest.raises(error, match=r"^SkipHealth\.observe\(" + match + r".*HINT"):
        health.observe(*args)
    assert health.state_dict() == before


def test_a_scale_that_backed_off_to_zero_is_observed_not_refused() -> None:
    # fp32 halving underflows to 0 after ~150 overflows in a row: a run to report, not to crash on.
    health = _health()
    verdict = health.observe(True, 0.0)
    assert verdict is not None and verdict.state == "pathological" and "the scale fell to 0" in verdict.reason
    resumed = _health()
    resumed.load_state_dict(health.state_dict())
    assert resumed.scale == 0.0 and resumed.state == "pathological"


def _saved() -> dict[str, Any]:
    health = _health()
    _run(health, "x......x", scales={8: 512.0})
    return health.state_dict()  # 8 steps, 2 skipped (1 in warm-up), the last one skipped


BAD_HEALTH_STATES: list[tuple[dict[str, Any], str]] = [
    ({"state": "ok"}, r"state='ok'\) is not allowed here: "
        r".*one of 'clean', 'warm-up', 'sporadic', 'pathological'"),
    ({"steps": "8"}, r"steps='8'\) is not allowed here: .*an int >= 0"),
    ({"steps": -1}, r"steps=-1\) is not allowed here: .*an int >= 0"),
    ({"skipped": 9}, r"skipped=9\) is not allowed here: .*an int from 0 to steps=8"),
    ({"steps": 0, "flags": []}, r"skipped=2\) is not allowed here: .*an int from 0 to steps=0"),
    ({"skipped": 1.0}, r"skipped=1.0\) is not allowed here: .*an int from 0 to steps=8"),
    ({"warmup_skipped": 3}, r"warmup_skipped=3\) is not allowed here: .*an int from 0 to skipped=2"),
    ({"consecutive": 3}, r"consecutive=3\) is not allowed here: .*an int from 0 to skipped=2"),
    ({"consecutive": 0}, r"consecutive=0\) is not allowed here: "
        r".*the number of skipped steps that end flags \(1\)"),
    ({"scale": "512"}, r"scale='512'\) is not allowed here: .*None or a finite number >= 0"),
    ({"scale": -1.0}, r"scale=-1.0\) is not allowed here: .*None or a finite number >= 0"),
    ({"scale": float("nan")}, r"scale=nan\) is not allowed"),
    ({"flags": "x......x"}, r"flags='x......x'\) is not allowed here: .*a list of bools"),
    ({"flags": [1, 0]}, r"flags=\[1, 0\]\) is not allowed here: .*a list of bools"),
    ({"flags": [False] * 9}, r"flags=.*\) is not allowed here: .*a list of bools, at most steps=8 long"),
    ({"flags": [True, True, True]}, r"flags=.*\) is not allowed here: .*.*with at most skipped=2 True"),
]


@pytest.mark.parametrize(("change", "match"), BAD_HEALTH_STATES)
def test_health_load_state_dict_checks_everything_before_changing_anything(
    change: dict[str, Any], match: str
) -> None:
    health = _health()
    _run(health, "x.")
    before = health.state_dict()
    with pytest.raises(ValueError, match=r"^SkipHealth\.load_state_dict\(" + match + r".*HINT"):
        health.load_state_dict({**_saved(), **change})
    assert health.state_dict() == before


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        (
            [("steps", 1)],
            TypeError,
            r"state_dict=list\) is not allowed here: .*the dict from SkipHealth\.state_dict",
        ),
        (
            {"steps": 1},
            ValueError,
            r"state_dict with keys \['steps'\]\) is not allowed here: .*.*missing .*'consecutive'",
        ),
    ],
)
def test_health_load_state_dict_refuses_a_foreign_state(
    state: Any, error: type[Exception], match: str
) -> None:
    health = _health()
    with pytest.raises(error, match=r"^SkipHealth\.load_state_dict\(" + match + r".*HINT"):
        health.load_state_dict(state)
    assert health.steps == 0 and health.state == "clean"
