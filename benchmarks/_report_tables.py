"""The headline numbers of each benchmark's JSON, as Markdown tables and one bar chart each.

``report.py`` calls ``summarize(name, payload)``; a benchmark without an entry in
``SUMMARIES`` still gets a table of the plain numbers in its JSON (``_generic``). Every table
carries a note that says what each of its numbers is: a median of what, and for a ratio, whether
it is the ratio of the medians beside it or the median of per-round (paired) ratios, which need
not equal the ratio of the medians when the machine's load moved between rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def loss_gap_row(gap: dict[str, Any]) -> list[str]:
    """One row of fp8.py's loss-gap table; a recipe this torch cannot run on the CPU says why."""
    if "skipped" in gap:
        return [gap["recipe"], "-", "-", f"skipped: {gap['skipped']}"]
    return [gap["recipe"], f"{gap['bf16_loss']:.4f}", f"{gap['fp8_loss']:.4f}", f"{100 * gap['gap']:+.2f}%"]


@dataclass
class Table:
    """A Markdown table and the note under it that says what each number is."""

    headers: list[str]
    rows: list[list[str]]
    note: str = ""


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

    lines = [row(table.headers), row(["---"] * len(table.headers)), *map(row, table.rows)]
    return "\n".join(lines) + (f"\n\n{table.note}" if table.note else "")


def _x(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}x"


def _passed(flag: object) -> str:
    return "met" if flag else "**missed**"


_PAIRED = (
    "median of the per-round ratios (each round times every case once, interleaved): it follows "
    "from pairs of runs, not from the medians beside it, and differs from their ratio when the "
    "machine's load moved between rounds"
)


def _step_overhead(p: dict[str, Any]) -> Summary:
    rows = [
        [r["path"], str(r["passes"]), f"{r['ms_median']:.2f}", f"{r['ratio_vs_baseline']:.3f}"]
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
    note = (
        "passes: reads and writes of the whole gradient set the path makes (its design, not "
        "measured); ms: median of the timed repeats, all paths interleaved; vs baseline: this "
        "path's ms / its baseline's ms (the copy floor for the unscale + clip rows, GradScaler's "
        "full step for the others): the ratio of the medians in this table."
    )
    target_note = "value: the ratio of medians the target names; status: met when value <= limit."
    return Summary(
        [
            Table(["path", "passes", "ms (median)", "vs baseline"], rows, note),
            Table(["target", "value", "limit", "status"], targets, target_note),
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
    note = (
        "samples/s: median over rounds of each run's batch size / median step time; vs fp32 (paired): "
        f"{_PAIRED}; host reads/step: `.item()`-like reads of a device value per training step "
        "(each waits for a GPU), median of a separate untimed run."
    )
    target_note = (
        f"ratio: {_PAIRED}; threshold: the target; host reads/step: as above, ours vs the baseline's."
    )
    return Summary(
        [
            Table(
                ["model", "optimizer", "set-up", "samples/s (median)", "vs fp32 (paired)", "host reads/step"],
                rows,
                note,
            ),
            Table(
                ["target", "ratio (paired)", "threshold", "status", "host reads/step (ours vs baseline)"],
                targets,
                target_note,
            ),
        ],
        bars,
    )


def _monitor_overhead(p: dict[str, Any]) -> Summary:
    names = list(p["steps_per_s"])
    rows = [
        [
            n,
            f"{p['steps_per_s'][n]:.2f}",
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
    note = (
        "steps/s: 1 / the median step time over every timed step of every fit of that configuration "
        "(fits interleaved); slowdown: no monitor's steps/s / this one's (the ratio of the steps/s "
        "beside it); hook us/step: median over fits of the time spent in the monitor's hooks per step."
    )
    return Summary([Table(["configuration", "steps/s", "slowdown", "hook us/step"], rows, note)], bars)


def _grad_accumulation(p: dict[str, Any]) -> Summary:
    names = list(p["ms_per_step"])
    ratio, final = p["cost_ratio"], p["final_loss"]
    rows = [
        [n, f"{p['ms_per_step'][n]:.1f}",
         _x(ratio[n.partition(" / ")[0]]) if n.endswith("fp32 sums") else "-", f"{final[n]:.4f}"]
        for n in names
    ]  # fmt: skip
    target = p["target_ratio"]
    bars = Bars(
        "fp32 gradient accumulation: cost", "time per step, fp32 sums / half .grad",
        list(ratio), list(ratio.values()), target, f"target {target}",
    )  # fmt: skip
    note = (
        "ms/step: median optimizer step (of --accumulate micro-batches) over the timed steps of every fit "
        "of that set-up (fits interleaved); fp32 sums / half: the ratio of the two ms/step of the same "
        "weights; loss: the mean training loss of the last quarter of the first fit's steps."
    )
    return Summary([Table(["set-up", "ms/step", "fp32 sums / half", "final loss"], rows, note)], bars)


def _flag_floor(p: dict[str, Any], base_ms: float) -> list[str]:
    us = p["flag_all_reduce_us"]
    return [
        "found_inf all-reduce alone (the floor)",
        f"{us:.0f} us = {us / 10 / base_ms:.2f}% of a sync-off step",
    ]


def _ddp_overhead(p: dict[str, Any]) -> Summary:
    low, high = p["ratio_quartiles"]
    base = p["ms_per_step"]["sync off"]
    rows = [[n, f"{ms:.2f}", _x(ms / base)] for n, ms in p["ms_per_step"].items()]
    ratio = f"{_x(p['ratio_on_vs_off'])} (quartiles {low:.3f}..{high:.3f})"
    facts = [
        ["parameters", f"{p['params']:,}"],
        ["sync on / sync off, median of per-round ratios", ratio],
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
    note = (
        "ms/step: median over rounds of the slowest rank's time for the round's steps, per step; "
        "vs sync off: the ratio of these medians."
    )
    facts_note = (
        f"sync on / sync off: {_PAIRED} (the target, 1.03, applies to it); the floor: one all-reduce "
        "of the inf flag timed alone, against the sync-off ms/step above."
    )
    return Summary(
        [
            Table(["mode", "ms/step (median)", "vs sync off (ratio of medians)"], rows, note),
            Table(["quantity", "value"], facts, facts_note),
        ],
        bars,
    )


def _fsdp_overhead(p: dict[str, Any]) -> Summary:
    names = list(p["ms_per_step"])
    base = p["ms_per_step"][names[0]]
    rows = [
        [
            n,
            f"{p['ms_per_step'][n]:.2f}",
            _x(p["ms_per_step"][n] / base),
            _x(p["ratio_vs_sync_off"][n]),
            f"{p['scaler_all_reduces_per_step'][n]:.0f}",
        ]
        for n in names
    ]
    facts = [["parameters", f"{p['params']:,}"], _flag_floor(p, base)]
    bars = Bars(
        "sync_found_inf under FSDP2",
        "time per step / sync off",
        names,
        [p["ratio_vs_sync_off"][n] for n in names],
        1.03,
        "target 1.03 (sync on)",
    )
    headers = [
        "scaler",
        "ms/step (median)",
        "ratio of medians",
        "vs sync off (paired)",
        "scaler all_reduce/step",
    ]
    note = (
        f"ms/step: median over rounds, per step; ratio of medians: this ms/step / sync off's; vs sync off "
        f"(paired): {_PAIRED} (the target, 1.03, applies to it); scaler all_reduce/step: collectives the "
        "scaler itself issued per step, counted."
    )
    facts_note = "the floor: one all-reduce of the inf flag timed alone, against the sync-off ms/step above."
    return Summary([Table(headers, rows, note), Table(["quantity", "value"], facts, facts_note)], bars)


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
    note = (
        "bytes/param: storage of every tensor that outlives a step (weights, gradients, optimizer "
        "state, masters, buffers), counted once, / parameters; peak MiB: peak resident memory of a "
        "fresh process above its size before the model was built; steps/s: 1 / the median step time, "
        "configurations interleaved."
    )
    target_note = "value: computed from the table above (O2 / O1 steps/s is the ratio of those two steps/s)."
    return Summary(
        [
            Table(["configuration", "bytes/param", "peak MiB", "steps/s"], rows, note),
            Table(["name", "value", "target", "status"], targets, target_note),
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
    note = (
        "ms / 1M elements: the median time of one call / its elements in millions; vs .to(dtype): "
        "the ratio of these medians for the same dtype."
    )
    return Summary([Table(["dtype", "method", "ms / 1M elements", "vs .to(dtype)"], rows, note)], bars)


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
    note = (
        "ms: median of the interleaved repeats (a step, or a batch of calls); vs no mode: this ms / "
        "the same group's no-mode ms (ratio of medians); fastest vs fastest: the same with each case's "
        "fastest repeat; extra us/torch call: (ms - no mode's ms) / the torch calls the mode sees."
    )
    headers = ["case", "ms (median)", "vs no mode", "fastest vs fastest", "extra us/torch call"]
    return Summary([Table(headers, rows, note)], bars)


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
    note = (
        "eager / compiled steps/s: median over rounds of each fit's steps/s; compiled/eager (paired): "
        f"{_PAIRED}; compile s: the first compiled batch's time minus the first eager batch's."
    )
    headers = ["set-up", "eager steps/s (median)", "compiled steps/s (median)", "compiled/eager (paired)"]
    return Summary([Table([*headers, "compile s"], rows, note)], bars)


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
                _x(r["amp_steps_per_s"] / r["fabric_steps_per_s"]),
                _x(r["ratio"]),
                f"{r['ratio_min']:.2f}..{r['ratio_max']:.2f}",
            ]
        )
    bars = Bars(
        "amp_plugin.lightning.fabric.AMPPrecision vs Fabric's MixedPrecision / HalfPrecision (paired)",
        "steps/s ratio",
        labels,
        [r["ratio"] for r in p["rows"]],
        1.0,
        "parity",
    )
    headers = [
        "model, precision", "AMPPrecision steps/s (median)", "Fabric's plugin steps/s (median)",
        "ratio of medians", "ratio (paired)", "per-round range",
    ]  # fmt: skip
    note = (
        "steps/s: median over rounds; ratio of medians: the two steps/s beside it divided; ratio "
        f"(paired): AMPPrecision / Fabric's, {_PAIRED}; per-round range: the smallest and largest "
        "per-round ratio. The two ratios far apart, or a wide range, mean a noisy machine: rerun."
    )
    return Summary([Table(headers, rows, note)], bars)


def _fp8(p: dict[str, Any]) -> Summary:
    """The error rows (per-layer SQNR, loss gap) and the speed rows (or why they were skipped)."""
    tables: list[Table] = []
    if "skipped" in p:
        return Summary([Table(["fp8", "result"], [["skipped", p["skipped"]]], "Nothing was measured.")])
    cpu = p.get("cpu")
    if cpu is not None:
        layers = [
            [
                layer["name"], f"{layer['in_features']}x{layer['out_features']}",
                "yes" if layer["converted"] else "no", _db(layer["output_sqnr_db"]),
                _db(layer["weight_grad_sqnr_db"]),
            ]
            for layer in cpu["layers"]
        ]  # fmt: skip
        layer_note = (
            f"Per Linear layer of a width-{cpu.get('dim', '?')} transformer on a sample batch: the SQNR "
            "(10 log10 of signal over error power, dB; 6 dB is about one bit) of its fp8 output and "
            "weight gradient against fp32; fp8 by rule: whether the default layer rule (keep_ends, "
            f"min_features 64 here) converts it. The report took {cpu['doctor_s']:.2f} s "
            "(what doctor --fp8 costs)."
        )
        tables.append(
            Table(
                ["layer", "in x out", "fp8 by rule", "output SQNR dB", "weight-grad SQNR dB"],
                layers,
                layer_note,
            )
        )
        gaps = [loss_gap_row(g) for g in cpu["loss"]]
        gap_note = (
            f"The same model, weights and batches trained {cpu.get('steps', '?')} AdamW steps under bf16 "
            f"autocast and with fp8 layers; loss: mean of the last {cpu['tail']} steps; gap: "
            "(fp8 - bf16) / bf16."
        )
        tables.append(Table(["recipe", "bf16 loss", "fp8 loss", "gap"], gaps, gap_note))
    speed = p.get("speed")
    bars = None
    if speed is not None and "skipped" in speed:
        tables.append(
            Table(["speed rows", "result"], [["fp8 vs bf16", f"skipped: {speed['skipped']}"]],
                  "No fp8 GPU here: see docs/benchmarks-gpu.md for the speed rows.")
        )  # fmt: skip
    elif speed is not None:
        tables += _fp8_speed(speed)
        ours = [(s["shape"], r) for s in speed["shapes"] for r in s["rows"] if r["case"].startswith("AMP")]
        bars = Bars(
            "AMPPrecision fp8 vs bf16, steps/s" + (" (smoke run)" if speed["smoke"] else ""),
            "bf16 ms / fp8 ms",
            [f"{shape}, {r['case'].split(' fp8 ')[1]}" for shape, r in ours],
            [r["vs_bf16"] for _, r in ours],
            1.15,
            "target 1.15 (8b-blocks), 1.3 (70b-layer)",
        )
    return Summary(tables, bars)


def _fp8_speed(speed: dict[str, Any]) -> list[Table]:
    rows = []
    for shape in speed["shapes"]:
        for r in shape["rows"]:
            rows.append([
                shape["shape"], r["case"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", _x(r["vs_bf16"]),
                _x(r["vs_torchao"]) if "vs_torchao" in r else "", f"{r['first_step_s']:.1f}",
            ])  # fmt: skip
    shapes = "; ".join(
        f"{s['shape']}: {s['describe']}{'' if s['compiled'] else ' (eager)'}" for s in speed["shapes"]
    )
    smoke = " Smoke run: tiny sizes, the numbers mean nothing." if speed["smoke"] else ""
    note = (
        f"One training step (forward under bf16 autocast, backward, fused AdamW) in Fabric on "
        f"{speed['device']}, cases interleaved. {shapes}. ms/step: median of the timed rounds; "
        "tokens/s: tokens per step / that median; vs bf16 and vs torchao (the same recipe converted by "
        "hand): ratios of these medians (above 1: faster); first step s: the first step, compile "
        f"included, timed apart.{smoke}"
    )
    headers = ["shape", "case", "ms/step (median)", "tokens/s", "vs bf16", "vs torchao", "first step s"]
    tables = [Table(headers, rows, note)]
    if speed["targets"]:
        targets = [
            [t["target"], _x(t["value"]), f">= {t['limit']}", _passed(t["passed"])] for t in speed["targets"]
        ]
        tables.append(
            Table(
                ["target", "value", "limit", "status"],
                targets,
                "value: a ratio of medians from the table above.",
            )
        )
    return tables


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


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
    note = "No summary for this benchmark yet: its JSON's numbers by key, as written (see its --help)."
    return Summary([Table(["key", "value"], rows, note)])


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
    "fp8": _fp8,
    "grad_accumulation": _grad_accumulation,
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
