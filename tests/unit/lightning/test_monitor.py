"""LossScaleMonitor without a Trainer.fit: its arguments, its own state, its bounded history."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from amp_plugin import LossScaleMonitor
from amp_plugin.diagnostics._health import SkipHealth
from amp_plugin.diagnostics._health_state import ScaleRecord


def _saved() -> dict[str, Any]:
    """A SkipHealth state: 8 steps, 2 skipped (1 in warm-up), the last one skipped."""
    health = SkipHealth(warmup_steps=5, window=10, max_consecutive_skips=3, max_skip_rate=0.25)
    for step, flag in enumerate("x......x", start=1):
        health.observe(flag == "x", 512.0 if step == 8 else None)
    return health.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1\) is not allowed here: .*an int >= 0"),
        ({"warmup_steps": "10"}, TypeError, r"warmup_steps='10'\) is not allowed here: .*an int >= 0"),
        ({"window": 0}, ValueError, r"window=0\) is not allowed here: .*an int >= 1"),
        ({"max_consecutive_skips": True}, TypeError, r"max_consecutive_skips=True\) is not allowed here: "
            r".*an int"),
        ({"max_skip_rate": 1.5}, ValueError, r"max_skip_rate=1.5\) is not allowed here: "
            r".*a finite number > 0 and"),
        ({"max_skip_rate": float("nan")}, ValueError, r"max_skip_rate=nan\) is not allowed here: "
            r".*a finite number"),
        ({"on_pathological": "stop"}, ValueError, r"on_pathological='stop'\) is not allowed here: "
            r".*one of 'warn', "
         r"'raise'"),
        ({"on_pathological": None}, ValueError, r"on_pathological=None\) is not allowed here: "
            r".*one of 'warn'"),
        ({"trace_nonfinite": 1}, TypeError, r"trace_nonfinite=1\) is not allowed here: .*a bool"),
        ({"trace_nonfinite": "False"}, TypeError, r"trace_nonfinite='False'\) is not allowed here: .*a bool"),
        ({"plot_path": 3}, TypeError, r"plot_path=3\) is not allowed here: .*None or a file path"),
    ],
)  # fmt: skip
def test_bad_arguments_raise(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=r"^LossScaleMonitor\(" + match + ".*HINT"):
        LossScaleMonitor(**kwargs)


def test_plot_without_matplotlib_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*HINT: pip install 'amp_plugin\[examples\]'"):
        LossScaleMonitor(plot_path="scale.png")


def _one_skip(grad_norm: float) -> dict[str, Any]:
    """What a monitor with window=4 (the other settings its defaults) saves after one skipped step."""
    health = SkipHealth(warmup_steps=100, window=4, max_consecutive_skips=10, max_skip_rate=0.05)
    health.observe(True, 512.0)
    return {"health": health.state_dict(), "records": [[1, 512.0, 1, grad_norm, True]]}


def test_monitor_state_dict_round_trip_uses_plain_values() -> None:
    monitor = LossScaleMonitor(window=4)
    monitor.load_state_dict(_one_skip(float("inf")))
    state = monitor.state_dict()
    assert state["records"] == [(1, 512.0, 1, float("inf"), True)] and type(state["records"][0]) is tuple
    other = LossScaleMonitor(window=4)
    other.load_state_dict(state)
    assert other.history == monitor.history and other.health == "warm-up"
    assert other.summary() == (
        "LossScaleMonitor: 1 steps, 1 skipped (1 in warm-up), skip rate 100.0% over the last 1 steps, "
        "scale 512; health: warm-up."
    )


def _monitor() -> LossScaleMonitor:
    monitor = LossScaleMonitor(window=4)
    monitor.load_state_dict(_one_skip(2.5))
    return monitor


def _monitor_state() -> dict[str, Any]:
    return {"health": _saved(), "records": [(0, 1024.0, 0, 1.0, False), (8, 512.0, 2, 3.0, True)]}


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1], TypeError, r"state_dict=list\) is not allowed here: "
            r".*the dict from LossScaleMonitor\.state_dict\(\)"),
        ({"lrs": [0.1]}, ValueError, r"state_dict with keys \['lrs'\]\) is not allowed here: .*the dict from "
         r"LossScaleMonitor\.state_dict\(\), with 'health' and 'records'"),
        ({"health": _saved()}, ValueError, r"state_dict with keys \['health'\]\) is not allowed"),
        ({**_monitor_state(), "health": {**_saved(), "skipped": 99}}, ValueError,
         r"health\['skipped'\]=99\) is not allowed here: .*an int from 0 to steps=8"),
        ({**_monitor_state(), "health": None}, ValueError, r"health=None\) is not allowed here: .*the dict"),
        ({**_monitor_state(), "records": "none"}, ValueError, r"records='none'\) is not allowed here: "
            r".*a list of"),
        ({**_monitor_state(), "records": [(0, 1.0, 0, 1.0)]}, ValueError,
         r"records\[0\]=\(0, 1.0, 0, 1.0\)\) is not allowed here: "
             r".*a \(step, scale, skipped_steps, grad_norm, "
         r"skipped\) tuple"),
        ({**_monitor_state(), "records": [(0, 1.0, 0, 1.0, False), ("1", 1.0, 0, 1.0, False)]}, ValueError,
         r"records\[1\]=\('1', 1.0, 0, 1.0, False\)\) is not allowed"),
        ({**_monitor_state(), "records": [(0, 1.0, 0, 1.0, "False")]}, ValueError, r"records\[0\]="),
        ({**_monitor_state(), "records": [(0, "1.0", 0, 1.0, False)]}, ValueError, r"records\[0\]="),
        ({**_monitor_state(), "records": [(0, 1.0, -1, 1.0, False)]}, ValueError, r"records\[0\]="),
    ],
)  # fmt: skip
def test_monitor_load_state_dict_checks_everything_before_changing_anything(
    state: Any, error: type[Exception], match: str
) -> None:
    monitor = _monitor()
    before = monitor.state_dict()
    with pytest.raises(error, match=r"^LossScaleMonitor\.load_state_dict\(" + match + r".*HINT"):
        monitor.load_state_dict(state)
    assert monitor.state_dict() == before
    fresh = LossScaleMonitor(window=4)
    with pytest.raises(error):
        fresh.load_state_dict(state)
    assert not fresh._restored  # a refused state is no resume (seen only inside a fit otherwise)


def test_monitor_loads_records_saved_as_lists() -> None:
    monitor = LossScaleMonitor(window=4)
    state = _monitor_state()
    monitor.load_state_dict({**state, "records": [list(r) for r in state["records"]]})  # e.g. through JSON
    assert monitor.history == [ScaleRecord(*r) for r in state["records"]]
    assert monitor.state_dict()["health"]["steps"] == 8


def test_history_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amp_plugin.lightning._monitor._MAX_RECORDS", 8)
    monitor = LossScaleMonitor()
    for step in range(100):
        monitor._record(ScaleRecord(step, 1.0, 0, 0.0, False))
    steps = [r.step for r in monitor.history]
    assert len(steps) <= 8 and steps[0] == 0 and steps[-1] == 99 and steps == sorted(steps)


def test_amp_plugin_is_the_one_public_path() -> None:
    import amp_plugin
    import amp_plugin.lightning
    from amp_plugin.lightning._monitor import LossScaleMonitor as Home

    assert LossScaleMonitor is Home is amp_plugin.LossScaleMonitor
    assert not hasattr(amp_plugin.lightning, "LossScaleMonitor")
