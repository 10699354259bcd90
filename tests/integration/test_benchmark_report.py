"""The benchmark report: its GPU path (``--device cuda``), its updates, and tables that say what they show.

The GPU report cannot run without a GPU, so its command line is checked here as far as a CPU
allows: it refuses without CUDA (with a HINT), and with CUDA's presence faked it writes
``benchmarks-gpu.md`` from a CPU-runnable stand-in. The table writer is checked on canned rows
(the JSON each benchmark writes), so no benchmark has to run for it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.integration.test_benchmarks import BENCHMARKS, REPORT, _load_tables, smoke_run

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = pytest.mark.slow

TABLES: ModuleType = _load_tables()
CANNED_GPU = {
    "GPU": "Canned GPU (capability 9.0)",
    "GPUs visible": "1",
    "CUDA (torch's)": "13.0",
    "torchao": "0.18.0",
}


def _cpu_stand_in(monkeypatch: pytest.MonkeyPatch, budget: float | None = None) -> None:
    """Fake a CUDA machine whose GPU report is one CPU-runnable benchmark."""
    monkeypatch.setattr(REPORT, "cuda_available", lambda: True)
    monkeypatch.setattr(REPORT, "gpu_info", lambda: dict(CANNED_GPU))
    stand_in = REPORT.GpuRun("--quick --device cpu", "--quick --device cpu", 120)
    monkeypatch.setattr(REPORT, "GPU_RUNS", {"numerics_speed.py": stand_in})
    if budget is not None:
        monkeypatch.setattr(REPORT, "GPU_BUDGET_S", budget)


def test_gpu_report_refuses_without_cuda_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(REPORT, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        REPORT.main(["--device", "cuda", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch sees no CUDA device" in err
    assert "HINT:" in err and "leave --device out" in err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_gpu_report_writes_its_own_page_with_the_gpu_in_the_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cpu_stand_in(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert (
        REPORT.main(["--device", "cuda", "--out-dir", str(tmp_path), "--json", str(tmp_path / "all.json")])
        == 0
    )
    assert not (tmp_path / "benchmarks.md").exists()  # the CPU report stays as it is
    results = json.loads((tmp_path / "all.json").read_text())  # what a GPU run brings back besides the page
    assert results["failed"] == [] and results["machine"]["GPU"] == CANNED_GPU["GPU"]
    assert results["benchmarks"]["numerics_speed.py"]["results"]
    report = (tmp_path / "benchmarks-gpu.md").read_text()
    assert report.startswith("# Benchmark report (GPU)\n")
    assert "`python benchmarks/report.py --device cuda`" in report
    for key, value in CANNED_GPU.items():
        assert f"| {key} | {value} |" in report
    assert "[benchmarks.md](benchmarks.md)" in report
    assert "`python benchmarks/numerics_speed.py --quick --device cpu`" in report
    assert "](img/benchmarks-gpu/numerics_speed.png)" in report
    assert (tmp_path / "img" / "benchmarks-gpu" / "numerics_speed.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_report_lists_what_its_budget_left_out_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cpu_stand_in(monkeypatch, budget=5.0)  # less than a benchmark is started with
    assert REPORT.main(["--device", "cuda", "--out-dir", str(tmp_path)]) == 1
    report = (tmp_path / "benchmarks-gpu.md").read_text()
    assert "**Not run**: the report's budget (5 s) ran out." in report
    assert "**Failed**: numerics_speed.py" in report


def test_gpu_runs_are_real_scripts_whose_options_exist_within_the_budget() -> None:
    assert set(REPORT.GPU_RUNS) <= set(REPORT.benchmarks())
    assert "fp8.py" in REPORT.GPU_RUNS and "step_overhead.py" in REPORT.GPU_RUNS
    assert sum(run.timeout_s for run in REPORT.GPU_RUNS.values()) <= REPORT.GPU_BUDGET_S <= 6.5 * 60
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    helps = {  # started together: each one's time is mostly its imports
        script: subprocess.Popen([sys.executable, str(BENCHMARKS / script), "--help"], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for script in REPORT.GPU_RUNS
    }  # fmt: skip
    for script, run in REPORT.GPU_RUNS.items():
        stdout, stderr = helps[script].communicate(timeout=120)
        assert helps[script].returncode == 0, stderr
        for flag in re.findall(r"--[\w-]+", f"{run.args} {run.quick}"):
            assert flag in stdout, f"{script} has no {flag} (its GPU report arguments use it)"


def test_update_replaces_only_the_named_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = (
        "# Benchmark report\n\nWritten by `python benchmarks/report.py`.\n\n"
        "## fabric_speed\n\nold fabric table\n\n## numerics_speed\n\nold numerics table\n"
    )
    (tmp_path / "benchmarks.md").write_text(old)
    monkeypatch.chdir(tmp_path)
    args = ["--update", "--quick", "--only", "numerics_speed.py", "--out-dir", str(tmp_path)]
    assert REPORT.main(args) == 0
    report = (tmp_path / "benchmarks.md").read_text()
    assert report.startswith("# Benchmark report\n\nWritten by `python benchmarks/report.py`.")
    assert "## fabric_speed\n\nold fabric table\n" in report  # kept as it was
    assert "old numerics table" not in report
    assert "`python benchmarks/numerics_speed.py --quick`" in report
    assert "**Updated (quick run: the numbers mean nothing)**: numerics_speed rerun by" in report
    assert report.index("## fabric_speed") < report.index("## numerics_speed")


def test_update_needs_a_report_and_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        REPORT.main(["--update", "--only", "numerics_speed.py", "--out-dir", str(tmp_path)])
    assert "HINT:" in capsys.readouterr().err


# -- the tables, on canned rows -----------------------------------------------------------------

_ENV = {"environment": {"torch": "2.13.0"}}
CANNED: dict[str, dict[str, Any]] = {
    "step_overhead": {
        "results": [
            {"path": "(a) GradScaler", "passes": 5, "ms_median": 20.0, "ratio_vs_baseline": 1.0,
             "baseline": "a", "key": "a"},
            {"path": "(b) LossScaler", "passes": 3, "ms_median": 13.0, "ratio_vs_baseline": 0.65,
             "baseline": "a", "key": "b"},
        ],
        "targets": [{"name": "(b)/(a)", "value": 0.65, "limit": 0.55, "passed": False}],
    },
    "training_speed": {
        "results": [
            {"model": "mlp", "optimizer": "fused", "setup": "fp32", "median": 4915.0, "vs_fp32": 1.0,
             "host_reads_per_step": 0},
            {"model": "mlp", "optimizer": "fused", "setup": "AMPPrecision bf16", "median": 16810.0,
             "vs_fp32": 3.36, "host_reads_per_step": 0},
        ],
        "targets": [
            {"target": "AMPPrecision bf16 >= 0.98x Lightning MixedPrecision bf16 (mlp, AdamW fused)",
             "ratio": 0.963, "threshold": 0.98, "passed": False, "host_reads_per_step": 0,
             "baseline_host_reads_per_step": 0},
        ],
    },
    "monitor_overhead": {
        "steps_per_s": {"no monitor": 12.8, "monitor": 12.7},
        "slowdown_vs_no_monitor": {"no monitor": 1.0, "monitor": 12.8 / 12.7},
        "hook_us_per_step": {"no monitor": 0.0, "monitor": 86.0},
        "target_slowdown": 1.02,
    },
    "grad_accumulation": {
        "ms_per_step": {"bf16-true / fp32 sums": 351.6, "bf16-true / half .grad": 340.6,
                        "O2 bf16 / fp32 sums": 352.9, "O2 bf16 / half .grad": 332.3, "fp32": 122.5},
        "cost_ratio": {"bf16-true": 351.6 / 340.6, "O2 bf16": 352.9 / 332.3},
        "target_ratio": 1.02,
        "final_loss": {"bf16-true / fp32 sums": 0.3875, "bf16-true / half .grad": 0.3875,
                       "O2 bf16 / fp32 sums": 0.3673, "O2 bf16 / half .grad": 0.3675, "fp32": 0.3673},
    },
    "ddp_overhead": {
        "params": 4_201_424, "ms_per_step": {"sync off": 273.83, "sync on": 296.05},
        "ratio_on_vs_off": 1.026, "ratio_quartiles": [1.005, 1.16], "flag_all_reduce_us": 286.0,
    },
    "fsdp_overhead": {
        "params": 4_201_424, "ms_per_step": {"LossScaler, sync off": 301.66, "LossScaler, sync on": 353.45},
        "ratio_vs_sync_off": {"LossScaler, sync off": 1.0, "LossScaler, sync on": 1.005},
        "scaler_all_reduces_per_step": {"LossScaler, sync off": 0, "LossScaler, sync on": 1},
        "flag_all_reduce_us": 207.0,
    },
    "memory": {
        "parameters": 658_944,
        "results": [{"config": "fp32", "bytes_per_param": 16.0, "peak_mib": 178.6, "steps_per_s": 52.19}],
        "targets": [{"name": "O2 / O1 steps/s", "value": 0.936, "target": ">= 0.95", "met": False}],
    },
    "numerics_speed": {
        "size": 4_000_000,
        "results": [
            {"dtype": "bf16", "method": ".to(dtype)", "ms_per_million": 0.922, "ratio": 1.0},
            {"dtype": "bf16", "method": "stochastic_round", "ms_per_million": 2.255, "ratio": 2.446},
        ],
    },
    "fp32_functions": {
        "results": {
            "step: no mode": {"median_ms": 20.755, "ratio": 1.0, "best_ratio": 1.0,
                              "extra_us_per_seen_call": 0.0},
            "step: mode": {"median_ms": 21.552, "ratio": 1.038, "best_ratio": 0.998,
                           "extra_us_per_seen_call": 13.3},
        },
    },
    "compile_speed": {
        "settings": {"backend": "inductor"},
        "results": [{"setup": "bf16", "eager_steps_per_s": [42.6], "compiled_steps_per_s": [42.5],
                     "ratio": 0.96, "compile_s": 5.7}],
    },
    "fabric_speed": {
        "rows": [
            {"model": "tiny", "precision": "bf16-true", "clip": False, "amp_steps_per_s": 1944.0,
             "fabric_steps_per_s": 1640.0, "ratio": 0.756, "ratio_min": 0.51, "ratio_max": 2.02},
        ],
    },
    "fp8": {
        "cpu": {
            "dim": 128, "steps": 60, "tail": 6, "doctor_s": 0.2054,
            "layers": [
                {"name": "blocks.0.qkv", "in_features": 128, "out_features": 384, "converted": False,
                 "output_sqnr_db": 28.4, "weight_grad_sqnr_db": 24.5},
                {"name": "blocks.0.fc1", "in_features": 128, "out_features": 512, "converted": True,
                 "output_sqnr_db": 28.8, "weight_grad_sqnr_db": None},
            ],
            "loss": [{"recipe": "tensorwise", "bf16_loss": 2.0, "fp8_loss": 2.0072, "gap": 0.0036}],
        },
        "speed": {
            "device": "NVIDIA H100 80GB HBM3", "smoke": False,
            "shapes": [{
                "shape": "8b-blocks", "describe": "2 x (width 4096, ...)", "compiled": True,
                "rows": [
                    {"case": "bf16", "ms": 120.0, "tokens_per_s": 136533.0, "vs_bf16": 1.0,
                     "first_step_s": 40.0},
                    {"case": "torchao fp8 tensorwise", "ms": 100.0, "tokens_per_s": 163840.0, "vs_bf16": 1.2,
                     "first_step_s": 60.0},
                    {"case": "AMPPrecision fp8 tensorwise", "ms": 101.0, "tokens_per_s": 162218.0,
                     "vs_bf16": 120 / 101, "vs_torchao": 100 / 101, "first_step_s": 20.0},
                ],
            }],
            "targets": [{"target": "AMPPrecision fp8 tensorwise / bf16 (8b-blocks)", "value": 120 / 101,
                         "limit": 1.15, "passed": True}],
        },
    },
}  # fmt: skip


def test_every_summary_has_canned_rows() -> None:
    assert set(CANNED) == set(TABLES.SUMMARIES)


@pytest.mark.parametrize("name", sorted(CANNED))
def test_every_table_says_what_its_numbers_are(name: str) -> None:
    summary = TABLES.summarize(name, {**_ENV, **CANNED[name]})
    assert summary.tables
    for table in summary.tables:
        assert len(table.note) > 40, f"{name}: a table without a note saying what its numbers are"
        assert table.rows and all(len(row) == len(table.headers) for row in table.rows)
        assert TABLES.markdown(table).endswith(table.note)
        # a paired ratio says so where it stands, a header or its note
        for header in table.headers:
            if "paired" in header:
                assert "per-round ratios" in table.note


def _cells(table: Any, column: str) -> list[str]:
    index = table.headers.index(column)
    return [row[index] for row in table.rows]


@pytest.mark.parametrize(
    ("name", "numerator", "denominator", "ratio"),
    [
        (
            "fabric_speed",
            "AMPPrecision steps/s (median)",
            "Fabric's plugin steps/s (median)",
            "ratio of medians",
        ),
        ("ddp_overhead", "ms/step (median)", None, "vs sync off (ratio of medians)"),
        ("fsdp_overhead", "ms/step (median)", None, "ratio of medians"),
    ],
)
def test_a_ratio_beside_medians_follows_from_them_and_a_paired_one_says_so(
    name: str, numerator: str, denominator: str | None, ratio: str
) -> None:
    """The issue's example: 1944 vs 1640 steps/s beside "0.756x", with nothing saying it was paired."""
    tables = TABLES.summarize(name, {**_ENV, **CANNED[name]}).tables
    nums = [float(c.replace(",", "")) for c in _cells(tables[0], numerator)]
    dens = (
        [float(c.replace(",", "")) for c in _cells(tables[0], denominator)]
        if denominator
        else [nums[0]] * len(nums)
    )
    for num, den, shown in zip(nums, dens, _cells(tables[0], ratio), strict=True):
        assert float(shown.rstrip("x")) == pytest.approx(num / den, abs=6e-3)
    assert "median of the per-round ratios" in " ".join(t.note for t in tables)


def test_fp8_section_shows_the_layer_error_loss_gap_and_speed_not_a_raw_dump() -> None:
    summary = TABLES.summarize("fp8", {**_ENV, **CANNED["fp8"]})
    text = "\n\n".join(TABLES.markdown(t) for t in summary.tables)
    assert "cpu.doctor_s" not in text and "cpu.tail" not in text
    layers, loss, speed, targets = summary.tables
    assert layers.headers[:3] == ["layer", "in x out", "fp8 by rule"]
    assert layers.rows[0] == ["blocks.0.qkv", "128x384", "no", "28.4", "24.5"]
    assert layers.rows[1][-1] == "-"  # a layer without a weight-gradient number
    assert loss.rows == [["tensorwise", "2.0000", "2.0072", "+0.36%"]]
    assert "mean of the last 6 steps" in loss.note
    assert _cells(speed, "case") == ["bf16", "torchao fp8 tensorwise", "AMPPrecision fp8 tensorwise"]
    assert _cells(speed, "vs torchao") == ["", "", "0.990x"]
    assert _cells(speed, "vs bf16")[2] == f"{120 / 101:.3f}x"
    assert "ratios of these medians" in speed.note
    assert targets.rows[0][-1] == "met"
    assert summary.bars is not None and summary.bars.values == [pytest.approx(120 / 101)]


def test_fp8_section_says_why_speed_was_skipped() -> None:
    payload = {
        **_ENV,
        "cpu": CANNED["fp8"]["cpu"],
        "speed": {"skipped": "needs a CUDA GPU of capability >= 8.9"},
    }
    tables = TABLES.summarize("fp8", payload).tables
    assert tables[-1].rows == [["fp8 vs bf16", "skipped: needs a CUDA GPU of capability >= 8.9"]]
    assert "benchmarks-gpu.md" in tables[-1].note


def test_fp8_speed_rows_put_raw_torchao_beside_the_plugin() -> None:
    """The speed rows' code path at smoke size, on the CPU (the smoke run of test_benchmarks.py)."""
    returncode, output, result = smoke_run("fp8.py")
    assert returncode == 0, output[-3000:]
    if "speed" not in result:  # no torchao: the smoke run says so and measures nothing
        pytest.skip(result["skipped"])
    speed = result["speed"]
    assert speed["smoke"] is True and speed["targets"] == []  # smoke sizes are held to no target
    rows = {r["case"]: r for r in speed["shapes"][0]["rows"]}
    unguarded = "AMPPrecision fp8 tensorwise, guard off"  # the conversion alone, beside torchao's
    assert set(rows) == {"bf16", "torchao fp8 tensorwise", "AMPPrecision fp8 tensorwise", unguarded}
    ours, theirs = rows["AMPPrecision fp8 tensorwise"], rows["torchao fp8 tensorwise"]
    assert ours["vs_torchao"] == pytest.approx(theirs["ms"] / ours["ms"])
    assert rows[unguarded]["vs_torchao"] == pytest.approx(theirs["ms"] / rows[unguarded]["ms"])
    assert ours["vs_bf16"] == pytest.approx(rows["bf16"]["ms"] / ours["ms"])
    assert "vs bf16" in output and "vs torchao" in output


def test_a_benchmark_cut_off_by_its_timeout_keeps_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8.py writes its JSON after each shape, so a GPU report whose budget cuts it short keeps those."""

    def cut_off(command: list[str], **kwargs: Any) -> None:
        out = Path(command[command.index("--json") + 1])
        out.write_text(json.dumps({**_ENV, **CANNED["numerics_speed"]}))
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(REPORT.subprocess, "run", cut_off)
    payload, error, _ = REPORT.run_one("numerics_speed.py", [], tmp_path, timeout=7)
    assert error == "" and payload["timed_out"] == 7
    section = REPORT.section("numerics_speed.py", [], payload, 7.0, tmp_path, "benchmarks-gpu")
    assert "**Timed out** after 7 s: the tables show what it measured before." in section
    assert "| bf16 | stochastic_round | 2.255 | 2.4x |" in section


def test_a_report_without_matplotlib_keeps_its_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_matplotlib(*args: Any) -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(TABLES, "plot", no_matplotlib)
    section = REPORT.section("numerics_speed.py", [], {**_ENV, **CANNED["numerics_speed"]}, 1.0, tmp_path)
    assert "(No chart: matplotlib is not installed.)" in section
    assert "| bf16 | stochastic_round | 2.255 | 2.4x |" in section


def test_update_clears_a_rerun_benchmark_from_the_failed_line() -> None:
    head = "# Benchmark report\n\nintro\n\n**Failed**: fp8.py, memory.py (see their sections)."
    old = head + "\n\n## fp8\n\n**Failed** (600 s): timed out\n\n## memory\n\nold\n"
    load = "load average (1, 5, 15 min) at the"
    header = {"date (UTC)": "2026-11-27 16:10", "torch": "2.13.0", f"{load} start": "1", f"{load} end": "2"}
    text = REPORT.updated(old, {"fp8.py": "## fp8\n\nnew fp8 tables\n"}, "cmd", 60.0, header)
    assert "**Failed**: memory.py (see their sections)." in text
    assert "new fp8 tables" in text and "timed out" not in text
    again = REPORT.updated(old, {"fp8.py": "## fp8\n\n**Failed**\n"}, "cmd", 60.0, header, failed=["fp8.py"])
    assert "**Failed**: memory.py, fp8.py (see their sections)." in again
    cleared = REPORT.updated(text, {"memory.py": "## memory\n\nnew\n"}, "cmd", 60.0, header)
    assert "**Failed**" not in cleared
    assert cleared.count("**Updated**: ") == 2  # fp8's, then memory's
    redone = REPORT.updated(cleared, {"fp8.py": "## fp8\n\nagain\n"}, "cmd", 60.0, header)
    assert redone.count("**Updated**: fp8 rerun") == 1 and "**Updated**: memory rerun" in redone
