"""LossScaleMonitor's own state (``state_dict``, ``load_state_dict``, bounded history), without a Trainer.

The SkipHealth tests moved to ``tests/diagnostics/test_health.py``; these test the Lightning callback
and move with it.
"""

from __future__ import annotations

from typing import Any

import pytest

from amp_plugin.callbacks import LossScaleMonitor
from amp_plugin.health import ScaleRecord
from tests.diagnostics.test_health import _saved


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


def _monitor() -> LossScaleMonitor:
    monitor = LossScaleMonitor(window=4)
    monitor._health.observe(True, 512.0)
    monitor._records.append(ScaleRecord(1, 512.0, 1, 2.5, True))
    return monitor


def _monitor_state() -> dict[str, Any]:
    return {"health": _saved(), "records": [(0, 1024.0, 0, 1.0, False), (8, 512.0, 2, 3.0, True)]}


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1], TypeError, r"state_dict=list\) is not allowed: the dict from LossScaleMonitor\.state_dict\(\)"),
        ({"lrs": [0.1]}, ValueError, r"state_dict with keys \['lrs'\]\) is not allowed: the dict from "
         r"LossScaleMonitor\.state_dict\(\), with 'health' and 'records'"),
        ({"health": _saved()}, ValueError, r"state_dict with keys \['health'\]\) is not allowed"),
        ({**_monitor_state(), "health": {**_saved(), "skipped": 99}}, ValueError,
         r"health\['skipped'\]=99\) is not allowed: an int from 0 to steps=8"),
        ({**_monitor_state(), "health": None}, ValueError, r"health=None\) is not allowed: the dict"),
        ({**_monitor_state(), "records": "none"}, ValueError, r"records='none'\) is not allowed: a list of"),
        ({**_monitor_state(), "records": [(0, 1.0, 0, 1.0)]}, ValueError,
         r"records\[0\]=\(0, 1.0, 0, 1.0\)\) is not allowed: a \(step, scale, skipped_steps, grad_norm, "
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
    assert monitor.state_dict() == before and not monitor._restored


def test_monitor_loads_records_saved_as_lists() -> None:
    monitor = LossScaleMonitor(window=4)
    state = _monitor_state()
    monitor.load_state_dict({**state, "records": [list(r) for r in state["records"]]})  # e.g. through JSON
    assert monitor.history == [ScaleRecord(*r) for r in state["records"]] and monitor._health.steps == 8


def test_history_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amp_plugin.callbacks._MAX_RECORDS", 8)
    monitor = LossScaleMonitor()
    for step in range(100):
        monitor._record(ScaleRecord(step, 1.0, 0, 0.0, False))
    steps = [r.step for r in monitor.history]
    assert len(steps) <= 8 and steps[0] == 0 and steps[-1] == 99 and steps == sorted(steps)
