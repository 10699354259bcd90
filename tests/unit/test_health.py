"""SkipHealth on scripted histories, and LossScaleMonitor's own state, without a Trainer."""

from __future__ import annotations

from typing import Any

import pytest

from amp_plugin.callbacks import LossScaleMonitor
from amp_plugin.health import ScaleRecord, SkipHealth


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
    ("kwargs", "match"),
    [
        ({"warmup_steps": 1.5}, r"warmup_steps=1.5\) is not allowed: an int >= 0"),
        ({"window": -3}, r"window=-3\) is not allowed: an int >= 1"),
        ({"max_consecutive_skips": 0}, r"max_consecutive_skips=0\) is not allowed: an int >= 1"),
        ({"max_skip_rate": 0}, r"max_skip_rate=0\) is not allowed: a number in \(0, 1\]"),
        ({"max_skip_rate": False}, r"max_skip_rate=False\) is not allowed"),
    ],
)
def test_bad_policy_raises(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=r"^SkipHealth\(" + match + r".*HINT"):
        SkipHealth(**kwargs)


def test_monitor_state_dict_round_trip_uses_plain_values() -> None:
    monitor = LossScaleMonitor(window=4)
    monitor._health.observe(True, 512.0)
    monitor._records.append(ScaleRecord(1, 512.0, 1, float("inf"), True))
    state = monitor.state_dict()
    assert state["records"] == [(1, 512.0, 1, float("inf"), True)] and type(state["records"][0]) is tuple
    other = LossScaleMonitor(window=4)
    other.load_state_dict(state)
    assert other.history == monitor.history and other.health == "warm-up"
    assert other.summary() == (
        "LossScaleMonitor: 1 steps, 1 skipped (1 in warm-up), skip rate 100.0% over the last 1 steps, "
        "scale 512; health: warm-up."
    )


def test_monitor_refuses_a_foreign_state() -> None:
    with pytest.raises(ValueError, match=r"expected the dict from LossScaleMonitor.state_dict\(\).*HINT"):
        LossScaleMonitor().load_state_dict({"lrs": [0.1]})


def test_history_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amp_plugin.callbacks._MAX_RECORDS", 8)
    monitor = LossScaleMonitor()
    for step in range(100):
        monitor._record(ScaleRecord(step, 1.0, 0, 0.0, False))
    steps = [r.step for r in monitor.history]
    assert len(steps) <= 8 and steps[0] == 0 and steps[-1] == 99 and steps == sorted(steps)
