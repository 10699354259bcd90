"""examples/limited_precision.py reproduces Gupta et al. 2015 qualitatively, at a reduced size.

Ten epochs per setting (about 3 s): at FL=8 round-to-nearest is far behind stochastic
rounding, which stays within a few points of float32 at every FL.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "limited_precision.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("limited_precision_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_stochastic_tracks_float_and_nearest_falls_behind_as_fl_shrinks() -> None:
    # One thread, as the example's main() pins: its small matmuls run several times slower with two
    # (the numbers are the same). Restored: a later test must not inherit this test's thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lines: list[str] = []
        curves = _example().run(epochs=10, lr=0.01, report=lines.append)
    finally:
        torch.set_num_threads(threads)
    final = {name: errors[-1] for name, errors in curves.items()}
    assert final["float32"] < 10  # the baseline learns (chance is 90% error)
    for fl in (14, 10, 8):
        assert abs(final[f"FL={fl} stochastic"] - final["float32"]) <= 3
    assert final["FL=8 nearest"] > final["FL=8 stochastic"] + 20  # updates below 2**-9 round to 0
    assert final["FL=8 nearest"] > final["FL=10 nearest"] > final["FL=14 nearest"] - 1
    assert lines[0].split()[:2] == ["setting", "<IL,"] and len(lines) == 1 + len(curves)


def test_the_plot_labels_its_log_axis_in_one_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain numbers (5, 10, 20, 50) on the test-error axis, not a mix of them and 10^k labels."""
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its ticks
    curve = [60.0, 30.0, 12.0, 6.0, 3.5, 2.2]
    curves = {
        "float32": curve,
        **{f"FL={fl} {r}": curve for fl in (14, 10, 8) for r in ("nearest", "stochastic")},
    }
    _example().plot(curves, tmp_path / "plot.png")
    fig = figures[0]
    fig.canvas.draw()
    shown = [  # the panels share the y axis: the first one labels it
        t.get_text() for t in [*fig.axes[0].get_yticklabels(), *fig.axes[0].get_yticklabels(minor=True)]
    ]
    shown = [text for text in shown if text]
    assert shown and all(re.fullmatch(r"\d+(\.\d+)?", text) for text in shown), shown
    close(fig)
