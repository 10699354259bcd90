"""The headline numbers of each benchmark's JSON, as Markdown tables and one bar chart each.

``report.py`` calls ``summarize(name, payload)``; a benchmark without an entry in
``SUMMARIES`` still gets a table of the plain numbers in its JSON (``_generic``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Bars:
    """A horizontal bar chart: one bar per label, and an optional reference line."""

    title: str
    xlabel: str
    labels: list[str]
    values: list[float]
    line: float | None = None
    line_label: str = ""


@dataclass
class Summary:
    tables: list[Table] = field(default_factory=list)
    bars: Bars | None = None


def markdown(table: Table) -> str:
    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([row(table.headers), row(["---"] * len(table.headers)), *map(row, table.rows)])


def _x(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}x"


def _passed(flag: object) -> str:
    return "met" if flag else "**missed**"


def _step_overhead(p: dict[str, Any]) -> Summary:
    rows = [
        [r["path"], r["passes"], f"{r['ms_median']:.2f}", f"{r['ratio_vs_baseline']:.3f}"]
        for r in p["results"]
    ]
    targets = [
        [t["name"], f"{t['value']:.3f}", f"<= {t['limit']}", _passed(t["passed"])] for t in p["targets"]
    ]
    clips = [r for r in p["results"] if r["baseline"] == "floor_copy" and r["key"] != "floor_copy"]
    bars = Bars(
        "unscale + clip vs one read+write copy of the gradients",
        "time / copy",
        [r["path"] for r in clips],
        [r["ratio_vs_baseline"] for r in clips],
        1.6,
        "GPU target (b) 1.6x the copy",
    )
    return Summary(
        [
            Table(["path", "passes", "ms (median)", "vs baseline"], rows),
            Table(["target", "value", "limit", "status"], targets),
        ],
        bars,
    )


_OPTIMIZERS = {"fused": "AdamW fused", "non-fused": "AdamW", "example": "Adam"}  # training_speed's labels


def _training_speed(p: dict[str, Any]) -> Summary:
    def reads(value: float | None) -> str:
        return "" if value is None else f"{value:g}"

    rows = [
        [
            r["model"], _OPTIMIZERS.get(r.get("optimizer", ""), ""), r["setup"], f"{r['median']:,.0f}",
            _x(r["vs_fp32"], 2), reads(r.get("host_reads_per_step")),
        ]
        for r in p["results"]
    ]  # fmt: skip
    targets = [
        [
            t["target"], _x(t["ratio"]), _x(t["threshold"], 2), _passed(t["passed"]),
            f"{reads(t.get('host_reads_per_step'))} vs {reads(t.get('baseline_host_reads_per_step'))}",
        ]
        for t in p["targets"]
    ]  # fmt: skip
    vs_lightning = [t for t in p["targets"] if "Lightning" in t["target"]]
    bars = Bars(
        "AMPPrecision vs Lightning MixedPrecision, same dtype",
        "samples/s ratio",
        # "bf16 mlp, AdamW fused": the set-up's dtype, then the target's parenthesis
        [
            f"{t['target'].split(' >= ')[0][len('AMPPrecision ') :]} {t['target'].split(' (', 1)[1][:-1]}"
            for t in vs_lightning
        ],
        [t["ratio"] for t in vs_lightning],
        0.98,
        "target 0.98 (tiny models: 1.00)",
    )
    return Summary(
        [
            Table(["model", "optimizer", "set-up", "samples/s", "vs fp32", "host reads/step"], rows),
            Table(["target", "ratio", "threshold", "status", "host reads/step (ours vs baseline)"], targets),
        ],
        bars,
    )


def _monitor_overhead(p: dict[str, Any]) -> Summary:
    names = list(p["steps_per_s"])
    rows = [
        [
            n,
            f"{p['steps_per_s'][n]:.1f}",
            _x(p["slowdown_vs_no_monitor"][n]),
            f"{p['hook_us_per_step'][n]:.0f}",
        ]
        for n in names
    ]
    target = p["target_slowdown"]
    bars = Bars(
        "LossScaleMonitor slowdown",
        "time per step / no monitor",
        names,
        [p["slowdown_vs_no_monitor"][n] for n in names],
        target,
        f"target {target}",
    )
    return Summary([Table(["configuration", "steps/s", "slowdown", "hook us/step"], rows)], bars)


def _flag_floor(p: dict[str, Any], base_ms: float) -> list[str]:
    us = p["flag_all_reduce_us"]
    return [
        "found_inf all-reduce alone (the floor)",
        f"{us:.0f} us = {us / 10 / base_ms:.2f}% of a sync-off step",
    ]


def _ddp_overhead(p: dict[str, Any]) -> Summary:
    low, high = p["ratio_quartiles"]
    rows = [[n, f"{ms:.2f}"] for n, ms in p["ms_per_step"].items()]
    base = p["ms_per_step"]["sync off"]
    ratio = f"{_x(p['ratio_on_vs_off'])} (quartiles {low:.3f}..{high:.3f})"
    facts = [
        ["parameters", f"{p['params']:,}"],
        ["sync on / sync off (paired median)", ratio],
        _flag_floor(p, base),
    ]
    bars = Bars(
        "sync_found_inf under DDP",
        "time per step / sync off",
        ["sync on (paired)", "flag all-reduce alone"],
        [p["ratio_on_vs_off"], 1 + p["flag_all_reduce_us"] / 1e3 / base],
        1.03,
        "target 1.03",
    )
    return Summary([Table(["mode", "ms/step"], rows), Table(["quantity", "value"], facts)], bars)


def _fsdp_overhead(p: dict[str, Any]) -> Summary:
    names = list(p["ms_per_step"])
    rows = [
        [
            n,
            f"{p['ms_per_step'][n]:.2f}",
            _x(p["ratio_vs_sync_off"][n]),
            f"{p['scaler_all_reduces_per_step'][n]:.0f}",
        ]
        for n in names
    ]
    facts = [["parameters", f"{p['params']:,}"], _flag_floor(p, p["ms_per_step"][names[0]])]
    bars = Bars(
        "sync_found_inf under FSDP2",
        "time per step / sync off",
        names,
        [p["ratio_vs_sync_off"][n] for n in names],
        1.03,
        "target 1.03 (sync on)",
    )
    table = Table(["scaler", "ms/step", "vs sync off (paired)", "scaler all_reduce/step"], rows)
    return Summary([table, Table(["quantity", "value"], facts)], bars)


def _memory(p: dict[str, Any]) -> Summary:
    rows = [
        [r["config"], f"{r['bytes_per_param']:.2f}", f"{r['peak_mib']:.1f}", f"{r['steps_per_s']:.2f}"]
        for r in p["results"]
    ]
    targets = [[t["name"], f"{t['value']:.3f}", t["target"], _passed(t["met"])] for t in p["targets"]]
    bars = Bars(
        f"training-state bytes per parameter ({p['parameters']:,} params)",
        "bytes / parameter",
        [r["config"] for r in p["results"]],
        [r["bytes_per_param"] for r in p["results"]],
        8.5,
        "target 8.5 (bf16 stochastic)",
    )
    return Summary(
        [
            Table(["configuration", "bytes/param", "peak MiB", "steps/s"], rows),
            Table(["name", "value", "target", "status"], targets),
        ],
        bars,
    )


def _numerics_speed(p: dict[str, Any]) -> Summary:
    rows = [[r["dtype"], r["method"], f"{r['ms_per_million']:.3f}", _x(r["ratio"], 1)] for r in p["results"]]
    sr = [r for r in p["results"] if r["method"] != ".to(dtype)"]
    bars = Bars(
        f"stochastic_round vs .to(dtype), {p['size']:,} elements",
        "time / .to(dtype)",
        [r["dtype"] for r in sr],
        [r["ratio"] for r in sr],
        1.0,
        ".to(dtype)",
    )
    return Summary([Table(["dtype", "method", "ms / 1M elements", "vs .to(dtype)"], rows)], bars)


def _fp32_functions(p: dict[str, Any]) -> Summary:
    res = p["results"]
    rows = [
        [
            n,
            f"{r['median_ms']:.3f}",
            _x(r["ratio"]),
            _x(r["best_ratio"]),
            f"{r['extra_us_per_seen_call']:.2f}",
        ]
        for n, r in res.items()
    ]
    moded = [n for n, r in res.items() if r["ratio"] != 1.0 or "no mode" not in n]
    bars = Bars(
        "Fp32Functions mode vs no mode",
        "time / no mode",
        moded,
        [res[n]["ratio"] for n in moded],
        1.0,
        "no mode",
    )
    return Summary(
        [Table(["case", "ms (median)", "vs no mode", "fastest vs fastest", "extra us/torch call"], rows)],
        bars,
    )


def _compile_speed(p: dict[str, Any]) -> Summary:
    res = p["results"]
    rows = [
        [
            r["setup"],
            f"{statistics.median(r['eager_steps_per_s']):.1f}",
            f"{statistics.median(r['compiled_steps_per_s']):.1f}",
            _x(r["ratio"], 2),
            f"{r['compile_s']:.1f}",
        ]
        for r in res
    ]
    bars = Bars(
        f"torch.compile ({p['settings']['backend']}) vs eager",
        "steps/s ratio",
        [r["setup"] for r in res],
        [r["ratio"] for r in res],
        1.0,
        "eager",
    )
    return Summary(
        [Table(["set-up", "eager steps/s", "compiled steps/s", "compiled/eager", "compile s"], rows)], bars
    )


def _fabric_speed(p: dict[str, Any]) -> Summary:
    rows, labels = [], []
    for r in p["rows"]:
        label = f"{r['model']} {r['precision']}{' clip' if r['clip'] else ''}"
        labels.append(label)
        rows.append(
            [
                label,
                f"{r['amp_steps_per_s']:.0f}",
                f"{r['fabric_steps_per_s']:.0f}",
                _x(r["ratio"]),
                f"{r['ratio_min']:.2f}..{r['ratio_max']:.2f}",
            ]
        )
    bars = Bars(
        "amp_plugin.fabric.AMPPrecision vs Fabric's MixedPrecision / HalfPrecision",
        "steps/s ratio",
        labels,
        [r["ratio"] for r in p["rows"]],
        1.0,
        "parity",
    )
    headers = ["model, precision", "AMPPrecision steps/s", "Fabric's plugin steps/s", "ratio", "range"]
    return Summary([Table(headers, rows)], bars)


def _generic(p: dict[str, Any]) -> Summary:
    """Every plain number of the JSON outside its environment and settings, by dotted key."""
    rows: list[list[str]] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, bool) or len(rows) >= 40:
            return
        if isinstance(value, (int, float)):
            rows.append([prefix, f"{value:.4g}"])
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)

    skip = {"environment", "config", "settings", "args", "samples_ms"}
    walk("", {k: v for k, v in p.items() if k not in skip})
    return Summary([Table(["key", "value"], rows)])


SUMMARIES: dict[str, Callable[[dict[str, Any]], Summary]] = {
    "step_overhead": _step_overhead,
    "training_speed": _training_speed,
    "monitor_overhead": _monitor_overhead,
    "ddp_overhead": _ddp_overhead,
    "fsdp_overhead": _fsdp_overhead,
    "memory": _memory,
    "numerics_speed": _numerics_speed,
    "fp32_functions": _fp32_functions,
    "compile_speed": _compile_speed,
    "fabric_speed": _fabric_speed,
}


def summarize(name: str, payload: dict[str, Any]) -> Summary:
    return SUMMARIES.get(name, _generic)(payload)


def plot(bars: Bars, path: Any) -> None:
    """Write ``bars`` as a PNG (matplotlib's Agg backend: no display needed)."""
    import matplotlib.pyplot as plt

    fig = figure(bars)
    fig.savefig(path)
    plt.close(fig)


def figure(bars: Bars) -> Any:
    """The bar chart as a matplotlib figure.

    The values stand in a column right of the plot and the reference line is named in the title,
    so neither a value nor a legend can sit on the line or on a bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.transforms

    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(bars.labels) + 1.6), dpi=100)
    positions = list(range(len(bars.labels)))[::-1]
    ax.barh(positions, bars.values, color="#4c72b0")
    ax.set_yticks(positions, [label if len(label) < 48 else label[:45] + "..." for label in bars.labels])
    column = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
    for y, value in zip(positions, bars.values, strict=True):
        ax.text(1.02, y, f"{value:.3g}", transform=column, va="center", fontsize=8)
    title = bars.title
    if bars.line is not None:
        ax.axvline(bars.line, color="#c44e52", linestyle="--")
        title += f"\n(dashed red line: {bars.line_label})" if bars.line_label else ""
    ax.set_xlabel(bars.xlabel)
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.05)
    fig.tight_layout()
    return fig
