"""Every benchmark runs end to end in a smoke configuration, prints its table and writes its JSON.

The numbers of a smoke run mean nothing (tiny sizes, a busy machine); what is checked is that
each script still runs against the current package and reports in its documented format.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._ahead import RunsAhead, selected_tests

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_report", BENCHMARKS / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = _load_report()
# The smoke arguments live in report.py, whose --quick runs them too: one list to keep up to date.
SMOKE_ARGS: dict[str, list[str]] = {script: args.split() for script, args in REPORT.QUICK_ARGS.items()}


def test_every_benchmark_has_a_smoke_run_and_a_report_size() -> None:
    # report.py runs the others (its own smoke run is test_report_quick_run below).
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")} - {"report.py"}
    assert set(REPORT.benchmarks()) == scripts
    assert set(SMOKE_ARGS) == scripts
    assert set(REPORT.SMALL_ARGS) == scripts


def test_every_benchmark_has_a_readme_section_and_takes_quick() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    for script in SMOKE_ARGS:
        assert f"## `{script}`" in readme, f"benchmarks/README.md has no section for {script}"
        assert "--quick" in SMOKE_ARGS[script]


def _cpu_env() -> dict[str, str]:
    """The smoke runs' environment: one OpenMP thread, and the CPU only.

    The smoke sizes are CPU sizes: a script that takes CUDA where it sees it (``fp8.py``'s GPU rows,
    a ``--device`` that defaults to ``cuda``) would otherwise compile and time GPU models here on a
    GPU machine. Its GPU rows are measured by ``report.py --device cuda``, not by a smoke run.
    """
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


SmokeResult = tuple[int, str, dict[str, Any]]


def _smoke_run_now(script: str) -> SmokeResult:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run(
            [sys.executable, str(BENCHMARKS / script), *SMOKE_ARGS[script], "--json", str(out)],
            cwd=tmp, env=_cpu_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return proc.returncode, proc.stdout + proc.stderr, json.loads(out.read_text()) if out.exists() else {}


# Each run is pinned to one thread (_cpu_env), so two overlap on a 2-core machine; their numbers
# are not checked.
_SMOKE_RUNS: RunsAhead[str, SmokeResult] = RunsAhead(_smoke_run_now)


def smoke_run(script: str) -> SmokeResult:
    """``script``'s smoke run on the CPU, once per session: exit code, output, its JSON (``{}`` if none)."""
    return _SMOKE_RUNS.result(script)


@pytest.mark.parametrize("script", sorted(SMOKE_ARGS))
def test_benchmark_smoke_run(script: str, request: pytest.FixtureRequest) -> None:
    # The first of these starts the smoke runs of every script selected in this session.
    smoke = [item for item in selected_tests(request) if item.originalname == "test_benchmark_smoke_run"]
    _SMOKE_RUNS.start([script, *(item.callspec.params["script"] for item in smoke)])
    returncode, output, result = smoke_run(script)
    assert returncode == 0, f"{script} exited {returncode}:\n{output[-3000:]}"
    assert any(set(line.strip()) <= {"-", " "} and "--" in line for line in output.splitlines()), output
    assert result["environment"]["torch"]
    assert Path(script).stem in str(result.get("benchmark", script))


def _takes_cuda(script: str) -> bool:
    """The script has ``--device`` with a ``"cuda"`` choice: a GPU path a smoke run can reach."""
    tree = ast.parse((BENCHMARKS / script).read_text())
    return any(
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "--device"
        and any(k.arg == "choices" and "cuda" in ast.literal_eval(k.value) for k in node.keywords)
        for node in ast.walk(tree)
    )


CUDA_SCRIPTS = sorted(script for script in SMOKE_ARGS if _takes_cuda(script))


def test_the_scripts_with_a_device_choice_are_found() -> None:
    assert {"step_overhead.py", "training_speed.py", "numerics_speed.py"} <= set(CUDA_SCRIPTS)


@pytest.mark.cuda
@pytest.mark.parametrize("script", CUDA_SCRIPTS)
def test_benchmark_smoke_run_on_cuda(script: str, tmp_path: Path) -> None:
    """The GPU path of each script that has one, in the smoke configuration, on this machine's GPU."""
    out = tmp_path / "result.json"
    args = [*SMOKE_ARGS[script], "--device", "cuda", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --device cuda exited {proc.returncode}:\n{output[-3000:]}"
    assert json.loads(out.read_text())["environment"]["device"] == "cuda"


def test_report_quick_run(tmp_path: Path) -> None:
    scripts = ["numerics_speed.py", "fp32_functions.py"]
    env = _cpu_env()
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "report.py"),
            "--quick",
            "--out-dir",
            str(tmp_path),
            "--only",
            *scripts,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "benchmarks.md").read_text()
    for key in ("| CPU |", "| torch |", "| lightning |", "| Python |", "| date (UTC) |", "load average"):
        assert key in report
    for script in scripts:
        name = Path(script).stem
        section = report.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert f"python benchmarks/{script} --quick" in section
        assert "| --- |" in section  # a Markdown table of its results
        assert f"](img/benchmarks/{name}.png)" in section
        assert (tmp_path / "img" / "benchmarks" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_lists_a_failing_benchmark_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(REPORT.QUICK_ARGS, "numerics_speed.py", "--quick --size not-a-number")
    monkeypatch.chdir(tmp_path)
    assert REPORT.main(["--quick", "--out-dir", str(tmp_path), "--only", "numerics_speed.py"]) == 1
    report = (tmp_path / "benchmarks.md").read_text()
    assert "**Failed**: numerics_speed.py" in report
    assert "exit code 2" in report


def _load_tables() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # report.py imports it as a sibling module
    try:
        spec = importlib.util.spec_from_file_location("_report_tables", BENCHMARKS / "_report_tables.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
        spec.loader.exec_module(sys.modules[spec.name])
    finally:
        sys.path.remove(str(BENCHMARKS))
    return sys.modules["_report_tables"]


def test_report_bar_values_and_the_target_line_never_overlap() -> None:
    """Values right at the target (0.959 next to a line at 0.98) used to be printed across it."""
    import matplotlib.pyplot as plt

    tables = _load_tables()
    bars = tables.Bars(
        title="AMPPrecision vs MixedPrecision", xlabel="samples/s ratio",
        labels=["bf16 (transformer)", "bf16 (mlp)", "fp16 (tiny)", "fp16 (tiny-hooks)"],
        values=[1.0, 1.01, 0.959, 0.935], line=0.98, line_label="target 0.98",
    )  # fmt: skip
    fig = tables.figure(bars)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        line_x = ax.transData.transform((0.98, 0))[0]
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert len(boxes) == 4
        assert all(not box.x0 <= line_x <= box.x1 for box in boxes)
        bar_boxes = [patch.get_window_extent(renderer) for patch in ax.patches]
        assert not any(box.overlaps(bar) for box in boxes for bar in bar_boxes)
        legend = ax.get_legend()
        assert legend is None or not any(legend.get_window_extent(renderer).overlaps(b) for b in bar_boxes)
        assert "target 0.98" in ax.get_title()
    finally:
        plt.close(fig)


def test_the_gpu_profile_script_runs_and_counts_the_calls_that_differ(tmp_path: Path) -> None:
    """benchmarks/gpu/profile_bf16_step.py (a profile, outside the report): its CPU smoke run."""
    out = tmp_path / "profile.json"
    script = BENCHMARKS / "gpu" / "profile_bf16_step.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        cwd=tmp_path, env=_cpu_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["mp", "amp", "amp-advance", "amp-noguard"]
    assert results["amp-noguard"]["calls_vs_mp_per_step"] == {}  # no guard: Lightning's very calls
    assert results["amp"]["calls_vs_mp_per_step"]["aten::_foreach_norm"] == 1  # the guard's one read
    assert "aten::item" not in results["amp-advance"]["calls_vs_mp_per_step"]  # no hold, no host read
    assert results["amp"]["calls_vs_mp_per_step"]["aten::item"] == 1  # the hold reads the fused flag


def test_the_gpu_norm_read_script_times_torchs_read_against_the_copy(tmp_path: Path) -> None:
    """benchmarks/gpu/norm_read.py (outside the report): its CPU smoke run, where only torch's reads run."""
    out = tmp_path / "norm_read.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu" / "norm_read.py"), "--quick", "--json", str(out)],
        cwd=tmp_path, env=_cpu_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "amp_C and Triton run on CUDA only" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["200k fp32 / 20", "30k bf16 / 30"]
    for layout in results.values():
        assert list(layout["ms"]) == ["copy", "foreach"] and layout["x_copy"]["copy"] == 1.0
        assert layout["rel_error_vs_fp64"]["foreach"] < 1e-5


def _load_script(script: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<script>`` as a module, for this test only (the scripts import ``_common``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"_bench_{Path(script).stem}", BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cases", [2, 3, 5, 6])
def test_two_rounds_run_every_pair_of_cases_both_ways(cases: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU report's 2 rounds of 5 set-ups ran MixedPrecision before AMPPrecision both times under
    # plain rotation: a process that slows down fit after fit then favours the first of each pair.
    common = _load_script("_common.py", monkeypatch)
    names = [f"case{i}" for i in range(cases)]
    rounds = [common.round_order(names, r) for r in range(2)]
    assert all(sorted(order) == names for order in rounds)
    for a, b in itertools.combinations(names, 2):
        assert {order.index(a) < order.index(b) for order in rounds} == {True, False}, (a, b, rounds)


def test_memory_counts_remainder_masters_at_14_bytes_per_param_at_the_call() -> None:
    """bf16 weight 2 + bf16 grad 2 + remainder 2 + AdamW 8; inside the step no more than O2 holds.

    Storage counts, not timings: the same on every machine. The fp32 norm layers (no masters,
    as under O2) hold 16 per parameter: 2 more than 14 per parameter of theirs.
    """
    returncode, output, result = smoke_run("memory.py")
    assert returncode == 0, output[-3000:]
    by = {r["config"]: r for r in result["results"]}
    remainder, o2 = by["O2 remainder"], by["O2 (masters)"]
    at_call = remainder["breakdown"]["at_call"]
    fp32_share = (at_call["weights"] - 2.0) / 2.0  # the bf16 weights give 2, the fp32 ones 4
    assert 0 < fp32_share < 0.01
    scalars = at_call["masters"] + at_call["state"] - 8.0  # the masters' 0-dim stand-ins, AdamW's step counts
    assert 0 <= scalars < 1e-3
    assert remainder["bytes_per_param"] - scalars == pytest.approx(14.0 + 2 * fp32_share), at_call
    assert at_call["grads"] == pytest.approx(at_call["weights"])  # as many bytes as the weights: bf16
    assert remainder["in_step_bytes_per_param"] <= o2["in_step_bytes_per_param"]
    # After the step (what the next forward holds until zero_grad) the gradients are bf16 again.
    assert remainder["after_step_bytes_per_param"] == pytest.approx(remainder["bytes_per_param"])
    assert o2["after_step_bytes_per_param"] == pytest.approx(o2["bytes_per_param"])
    assert next(t for t in result["targets"] if t["name"] == "O2 remainder B/param")["met"]


def test_training_speed_times_the_spike_guard_against_the_same_guard_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The spike guard's cost target (<= 2% of a step) is a ratio of two rows of one run: the same
    # AMPPrecision bf16 with and without a guard watching both signals, on the transformer.
    speed = _load_script("training_speed.py", monkeypatch)
    for device in ("cpu", "cuda"):
        assert (speed.AMP_BF16_SPIKE, speed.AMP_BF16, 0.98) in speed._checks("transformer", device)
        assert not [c for c in speed._checks("mlp", device) if speed.AMP_BF16_SPIKE in c]
    spiked = speed.make_plugin(speed.AMP_BF16_SPIKE, "cpu")
    assert spiked.spike_guard is not None and spiked.spike_guard.on == ("loss", "grad_norm")
    assert speed.make_plugin(speed.AMP_BF16, "cpu").spike_guard is None
