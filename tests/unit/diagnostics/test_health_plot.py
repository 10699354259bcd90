"""Tests for ``amp_plugin.diagnostics._health_plot``: what the saved figure shows."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")
from matplotlib.figure import Figure

from amp_plugin.diagnostics._health import SkipHealth
from amp_plugin.diagnostics._health_plot import plot_history
from amp_plugin.diagnostics._health_state import ScaleRecord


def _drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, records: list[ScaleRecord], **kw: Any) -> Figure:
    saved: list[Figure] = []
    original = Figure.savefig

    def spy(self: Figure, *args: Any, **kw: Any) -> None:
        saved.append(self)
        original(self, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_history(records, tmp_path / "scale.png", SkipHealth(warmup_steps=2), **kw)
    assert (tmp_path / "scale.png").stat().st_size > 0
    return saved[0]


def _records() -> list[ScaleRecord]:
    scales = [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**14, 2.0**14]
    skipped = [False, True, True, False, False, True, False]
    out, count = [], 0
    for step, (scale, skip) in enumerate(zip(scales, skipped, strict=True), start=1):
        count += skip
        out.append(ScaleRecord(step, scale, count, math.inf if skip else 1.0, skip))
    return out


def test_scale_axis_reads_in_powers_of_two_and_skips_are_labelled_cumulative(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fig = _drawn(monkeypatch, tmp_path, _records())
    top, bottom = fig.axes
    fig.canvas.draw()
    labels = [t.get_text() for t in top.get_yticklabels() if t.get_text()]
    assert labels and all(label.startswith("$2^{") for label in labels), labels
    assert "cumulative" in bottom.get_ylabel()


def test_events_are_marked_and_named_in_the_legend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fig = _drawn(monkeypatch, tmp_path, _records(), events=[(6, "corrupted batch (injected)")])
    top = fig.axes[0]
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert "step 6: corrupted batch (injected)" in legend
    assert any(list(line.get_xdata()) == [6, 6] for line in top.get_lines())


def test_bad_events_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"LossScaleMonitor\(plot_events=\[\(6,\)\]\) is not allowed here"):
        plot_history(_records(), tmp_path / "scale.png", SkipHealth(), events=[(6,)])  # type: ignore[list-item]
    assert not (tmp_path / "scale.png").exists()
