"""Draw a run's loss scale (or, without one, its gradient norm) and its skipped steps.

Behind ``LossScaleMonitor(plot_path=...)``; matplotlib is an optional dependency, imported only
when a plot is drawn (:func:`amp_plugin._imports.matplotlib_available` says whether it can be).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from amp_plugin._validation import fail
from amp_plugin.diagnostics._health import SkipHealth
from amp_plugin.diagnostics._health_state import ScaleRecord

__all__ = ["plot_history"]


def plot_history(
    records: list[ScaleRecord], path: Path, health: SkipHealth, events: Sequence[tuple[int, str]] = ()
) -> None:
    """Save a figure of ``records`` to ``path``, creating its folder.

    Top: the loss scale (log2 axis, ticks labelled 2^k) with the skipped steps marked,
    ``health``'s warm-up shaded and its ``min_scale`` drawn; without a scale (bf16) the
    unscaled gradient norm instead. Bottom: the cumulative count of skipped steps. Each
    ``(step, label)`` of ``events`` (an injected fault, a restart) is a dotted vertical line,
    named in the legend.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``events`` is not a sequence of ``(step, label)`` pairs.

    Example:
        >>> import tempfile
        >>> records = [ScaleRecord(0, 2.0**16, 0, 1.0, False), ScaleRecord(1, 2.0**15, 1, math.inf, True)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     plot_history(records, Path(folder) / "scale.png", SkipHealth())
        ...     (Path(folder) / "scale.png").stat().st_size > 0
        True
    """
    if not isinstance(events, (list, tuple)) or not all(
        isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], str)
        for e in events
    ):
        fail(
            "LossScaleMonitor",
            passed=f"plot_events={events!r:.80}",
            allowed="a sequence of (step: int, label: str) pairs",
            hint="append pairs such as (300, 'corrupted batch') to monitor.plot_events.",
            error=TypeError,
        )
    from matplotlib.figure import Figure  # optional: LossScaleMonitor checks for it when constructed
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax_top, ax_skip = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    scaled = [r for r in records if not math.isnan(r.scale)]
    last = records[-1].step if records else 0
    if scaled and health.warmup_steps:
        for ax in (ax_top, ax_skip):
            ax.axvspan(
                0, min(health.warmup_steps, last), color="0.93", label="warm-up" if ax is ax_top else None
            )
    if scaled:
        ax_top.step([r.step for r in scaled], [r.scale for r in scaled], where="post", label="loss scale")
        skips = [r for r in scaled if r.skipped]
        ax_top.plot(
            [r.step for r in skips], [r.scale for r in skips], "x", color="tab:red", label="skipped step"
        )
        if health.min_scale is not None:
            ax_top.axhline(health.min_scale, color="0.4", linestyle="--", label="min_scale")
        ax_top.set_yscale("log", base=2)
        ax_top.yaxis.set_major_locator(LogLocator(base=2))
        ax_top.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"$2^{{{math.log2(y):.0f}}}$"))
        ax_top.set_ylabel("loss scale")
        ax_top.set_title(f"Loss scale and skipped steps (health: {health.state})")
    else:  # bf16: no scale to show; the unscaled gradient norm is the next best thing
        normed = [r for r in records if math.isfinite(r.grad_norm) and r.grad_norm > 0]
        ax_top.plot([r.step for r in normed], [r.grad_norm for r in normed], ".-", label="gradient norm")
        ax_top.set_yscale("log")
        ax_top.set_ylabel("gradient norm (unscaled)")
        ax_top.set_title(f"Gradient norm and skipped steps (no loss scale; health: {health.state})")
    colors = ("tab:purple", "tab:olive", "tab:cyan", "tab:brown") * len(events)
    for (step, label), color in zip(events, colors[: len(events)], strict=True):
        ax_top.axvline(step, color=color, linestyle=":", label=f"step {step}: {label}")
        ax_skip.axvline(step, color=color, linestyle=":")
    ax_top.legend(loc="best", fontsize="small")
    ax_skip.step([r.step for r in records], [r.skipped_steps for r in records], where="post", color="tab:red")
    ax_skip.set_ylabel("skipped steps (cumulative)")
    ax_skip.set_xlabel("global step")
    for ax in (ax_top, ax_skip):
        ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
