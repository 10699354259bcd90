"""The examples run end to end (short ``--smoke`` runs, each in its own process) and say what they did."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._ahead import RunsAhead, selected_tests

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# What a newcomer should not have to wade through: Lightning's hardware banner and advert, library
# import chatter (torchao's skipped extensions, torch's notices), deprecation warnings.
NOISE = ("GPU available:", "TPU available:", "Tip: For seamless", "Failed to load", "Skipping import of cpp",
         "register_constant", "is deprecated", "DeprecationWarning")  # fmt: skip


def _assert_readable(script: str, output: str) -> None:
    """Every line fits a terminal (under 200 characters) and none is noise."""
    long = [line for line in output.splitlines() if len(line) >= 200]
    assert not long, f"{script}: lines of 200 characters or more:\n" + "\n".join(long)
    noisy = [line for line in output.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, f"{script}: noise in the output:\n" + "\n".join(noisy)


# Run as if on a 16-core machine (a GPU machine's CPU): Lightning's advice that depends on the core
# count (more DataLoader workers) must not reach the console there either.
_MANY_CORES = "import os\nos.cpu_count = lambda: 16\nos.sched_getaffinity = lambda pid: set(range(16))\n"


def _run(script: str, *args: str, cwd: Path, omp_threads: str | None = "1") -> str:
    env = dict(os.environ)
    (cwd / "_many_cores").mkdir(exist_ok=True)
    (cwd / "_many_cores" / "sitecustomize.py").write_text(_MANY_CORES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd / "_many_cores"), env.get("PYTHONPATH")]))
    # One intra-op thread: next to other test processes, a second OpenMP thread that waits for a
    # core makes every op wait a scheduler slice, and a 4 s run takes a minute.
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = omp_threads
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke", *args],
        cwd=cwd,  # the CSV logs land under cwd/runs
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    _assert_readable(script, proc.stdout + proc.stderr)
    return proc.stdout + proc.stderr


# The runs of the tests below, by test: script, its arguments, OMP_NUM_THREADS (None: unset). Each
# pins one thread, so they run ahead of their tests, two at a time (tests/_ahead.py).
RUNS: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "test_quickstart_auto_picks_bf16_on_cpu_pins_its_threads_and_compares_with_fp32":
        ("quickstart.py", ("--accelerator", "cpu"), None),  # the quickstart pins its own threads
    "test_quickstart_fp16_reports_the_scaler":
        ("quickstart.py", ("--accelerator", "cpu", "--precision", "16-mixed"), "1"),
    "test_fp16_scaler_shows_warmup_growth_and_the_injected_overflow":
        ("fp16_scaler.py", ("--plot", "runs/scale.png"), "1"),
    "test_ddp_example_ranks_agree": ("ddp.py", ("--devices", "2", "--precision", "16-mixed"), "1"),
    "test_master_weights_example_shows_the_weight_backup_effect_and_the_opt_levels":
        ("master_weights.py", (), "1"),
    "test_limited_precision_example_prints_the_table_and_writes_the_plot": ("limited_precision.py", (), "1"),
    "test_fabric_example_skips_clips_and_resumes_bit_exactly": ("fabric.py", (), "1"),
    "test_fp8_example_trains_both_and_reports_the_layers": ("fp8.py", (), "1"),
}  # fmt: skip
_WORKDIRS: list[Path] = []  # the session's folder for these runs, set by the first test that asks


def _run_for(test: str) -> tuple[str, Path]:
    script, args, omp_threads = RUNS[test]
    cwd = _WORKDIRS[0] / test
    cwd.mkdir()
    return _run(script, *args, cwd=cwd, omp_threads=omp_threads), cwd


_AHEAD: RunsAhead[str, tuple[str, Path]] = RunsAhead(_run_for)


def example_run(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """The output of the calling test's run (``RUNS``) and the folder it ran in.

    The first call starts the runs of every selected test of this file.
    """
    if not _WORKDIRS:
        _WORKDIRS.append(request.getfixturevalue("tmp_path_factory").mktemp("examples"))
    _AHEAD.start(item.originalname for item in selected_tests(request) if item.originalname in RUNS)
    return _AHEAD.result(request.node.originalname)


def _summary_value(output: str, key: str) -> str:
    summary = output.rsplit("\nSummary\n", 1)[-1]
    for line in summary.splitlines():
        name, _, value = line.strip().partition(":")
        if name == key:
            return value.strip()
    raise AssertionError(f"no {key!r} line in the summary:\n{summary}")


def test_quickstart_auto_picks_bf16_on_cpu_pins_its_threads_and_compares_with_fp32(
    request: pytest.FixtureRequest,
) -> None:
    # Without OMP_NUM_THREADS torch would take one thread per core; the quickstart pins its own.
    out, cwd = example_run(request)
    assert _summary_value(out, "device").startswith("cpu (1 intra-op thread, 1 inter-op thread")
    fp32 = _summary_value(out, "vs fp32")  # "AMPPrecision 0.62x fp32 (1130 against 1830 samples/s ...)"
    assert fp32.startswith("bf16-mixed ") and "x fp32 (" in fp32
    assert float(fp32.split()[1].rstrip("x")) > 0
    assert "AMPPrecision('auto') chose bf16-mixed" in out
    assert _summary_value(out, "precision").startswith("bf16-mixed  (auto: bf16: CPU autocast supports bf16)")
    assert _summary_value(out, "loss scaling").startswith("none needed for bf16")
    assert "the guard skipped 0 of" in _summary_value(out, "loss scaling")
    assert float(_summary_value(out, "throughput").split()[0]) > 0
    model = _summary_value(out, "model")
    assert model.startswith("MajorityTransformer (2 encoder layers, d_model 64), 0.07M")
    assert _summary_value(out, "data").startswith("512 sequences of 32 tokens over 8 symbols")
    assert _summary_value(out, "training").startswith("12 steps of batch 32")
    # Even 12 steps of the small smoke model beat chance (12.5%) by a margin.
    assert float(_summary_value(out, "val accuracy").split("%")[0]) > 25
    assert (cwd / "runs" / "quickstart" / "version_0" / "metrics.csv").is_file()
    # Not a terminal (a pipe here, a log file or CI elsewhere): plain lines, no progress-bar redraws.
    assert "\r" not in out
    assert "step 6/12: loss " in out and "step 6/12: val_acc " in out and "step 12/12: loss " in out


@pytest.mark.cuda
def test_quickstart_auto_picks_by_the_gpus_compute_capability(tmp_path: Path) -> None:
    out = _run("quickstart.py", "--accelerator", "cuda", cwd=tmp_path)
    major, minor = torch.cuda.get_device_capability()
    expected = (
        f"bf16-mixed  (auto: bf16: CUDA device with compute capability {major}.{minor} >= 8.0)"
        if major >= 8
        else f"16-mixed  (auto: fp16: CUDA device with compute capability {major}.{minor} < 8.0 (no bf16))"
    )
    assert _summary_value(out, "precision") == expected
    assert _summary_value(out, "device") == f"cuda ({torch.cuda.get_device_name()})"
    assert float(_summary_value(out, "val accuracy").split("%")[0]) > 25


def test_quickstart_names_the_device_it_trained_on_not_where_the_model_ends_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Lightning moves the model back to the CPU after fit: on a GPU the summary said "cpu".
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("quickstart_for_summary", EXAMPLES / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, quickstart)  # its dataclass looks itself up there
    spec.loader.exec_module(quickstart)
    model = quickstart.MajorityTransformer()  # on the CPU, as after a fit on any device
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("meta")), global_step=3,
        callback_metrics={"val_acc": torch.tensor(0.5)}, log_dir="runs",
    )  # fmt: skip
    throughput = SimpleNamespace(samples_per_second=1.0)
    summary = quickstart.summarize(trainer, None, model, throughput, None, 1.0)
    assert summary["device"].startswith("meta ("), summary["device"]


def test_quickstart_keeps_lightnings_tensor_core_advice_out_of_its_console(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # On an Ampere-or-later GPU Lightning logs a 330-character line asking for TF32 matmuls; the
    # quickstart's fp32 comparison runs true fp32 on purpose, so the advice is noise there.
    import importlib.util
    import logging

    from lightning.fabric.accelerators import cuda as lightning_cuda

    spec = importlib.util.spec_from_file_location("quickstart_for_banners", EXAMPLES / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, quickstart)
    spec.loader.exec_module(quickstart)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    monkeypatch.setattr(logger, "filters", list(logger.filters))  # the quickstart's filter goes with the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(lightning_cuda, "_is_ampere_or_later", lambda device=None: True)
    quickstart.quiet_lightning()
    with caplog.at_level(logging.INFO):
        lightning_cuda._check_cuda_matmul_precision.__wrapped__(torch.device("cuda"))
        logger.info("a message worth reading")
    assert [record.getMessage() for record in caplog.records] == ["a message worth reading"]


def test_quickstart_fp16_reports_the_scaler(request: pytest.FixtureRequest) -> None:
    out, _ = example_run(request)
    assert _summary_value(out, "precision").startswith("16-mixed")
    scaling = _summary_value(out, "loss scaling")
    assert scaling.startswith("final scale ") and "of 12 steps" in scaling


def test_fp16_scaler_shows_warmup_growth_and_the_injected_overflow(request: pytest.FixtureRequest) -> None:
    out, cwd = example_run(request)
    assert _summary_value(out, "plot").startswith("runs/scale.png (")
    assert "plot of the loss scale and skips written to runs/scale.png" in out
    assert (cwd / "runs" / "scale.png").stat().st_size > 0
    assert "fp16 gradients overflowed: step skipped, scale x0.5" in out  # warm-up back-off from 2**16
    assert "clean steps in a row: scale x2" in out
    assert "loss is inf/NaN (fp16 forward overflowed): step skipped" in out  # the smoke run injects at 45
    assert int(_summary_value(out, "warm-up").split()[0]) >= 1
    later = _summary_value(out, "later")  # "2 at steps [12, 45]"
    assert 45 in ast.literal_eval(later.partition("at steps ")[2])
    assert _summary_value(out, "skipped steps").endswith("of 60")


def test_ddp_example_ranks_agree(request: pytest.FixtureRequest) -> None:
    out, _ = example_run(request)
    assert "precision     16-mixed on 2 x cpu" in out
    assert "ranks agree" in out
    assert "loss scaler   scale" in out
    assert "val_dataloader" not in out  # the example trains only; Lightning's note would say nothing new
    assert "\r" not in out


def test_master_weights_example_shows_the_weight_backup_effect_and_the_opt_levels(
    request: pytest.FixtureRequest,
) -> None:
    out, _ = example_run(request)
    assert "fp16 + master  0.9980" in out  # 20 updates of 1e-4 kept
    assert "fp16 alone     1.0000" in out  # and lost
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.strip()[:2] in ("O0", "O1", "O2", "O3")
    }
    assert rows["O0"][1:4] == ["32-true", "float32", "float32"]
    assert rows["O2"][1:4] == ["16-mixed", "float16", "float32"]
    assert rows["O3"][1:4] == ["16-true", "float16", "float16"]
    assert float(rows["O3"][5]) == 8.0 and float(rows["O0"][5]) == 16.0


def test_limited_precision_example_prints_the_table_and_writes_the_plot(
    request: pytest.FixtureRequest,
) -> None:
    out, cwd = example_run(request)
    rows = [line.split() for line in out.splitlines() if line.startswith(("float32", "FL="))]
    assert [" ".join(r[:2]) for r in rows] == ["float32 -", "FL=14 nearest", "FL=14 stochastic",
        "FL=10 nearest", "FL=10 stochastic", "FL=8 nearest", "FL=8 stochastic"]  # fmt: skip
    assert all(0 <= float(r[-2]) <= 100 for r in rows)
    assert "plot written to runs/limited_precision.png" in out
    assert (cwd / "runs" / "limited_precision.png").stat().st_size > 1000


def test_fabric_example_skips_clips_and_resumes_bit_exactly(request: pytest.FixtureRequest) -> None:
    out, _ = example_run(request)
    assert _summary_value(out, "precision").startswith("16-mixed (torch.float16) with LossScaler")
    skipped = ast.literal_eval(_summary_value(out, "skipped steps").partition("at steps ")[2])
    assert 1 in skipped and 0 not in skipped  # the warm-up skip, counted from 1 as everywhere
    assert "(unscaled, before each clip to 5.0)" in _summary_value(out, "grad norm")
    assert _summary_value(out, "resume") == "bit-exact"


def _argument_calls(tree: ast.AST) -> list[ast.Call]:
    """``parser.add_argument(...)`` calls, and calls of an alias of it (``add = parser.add_argument``)."""
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "add_argument"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument")
            or (isinstance(node.func, ast.Name) and node.func.id in aliases)
        )
    ]


def test_every_example_argument_has_a_help_text() -> None:
    missing = []
    for script in sorted(EXAMPLES.glob("*.py")):
        calls = _argument_calls(ast.parse(script.read_text()))
        assert calls, f"{script.name} has no command-line arguments"
        for call in calls:
            if not any(k.arg == "help" for k in call.keywords):
                missing.append(f"{script.name} {ast.literal_eval(call.args[0])}")
    assert not missing, f"arguments without --help text: {missing}"


def test_every_example_pins_one_thread_by_default() -> None:
    for script in sorted(EXAMPLES.glob("*.py")):
        for call in _argument_calls(ast.parse(script.read_text())):
            if call.args and ast.literal_eval(call.args[0]) == "--threads":
                default = next(k.value for k in call.keywords if k.arg == "default")
                assert ast.literal_eval(default) == 1, script.name


def test_limited_precision_without_scikit_learn_says_what_to_install(tmp_path: Path) -> None:
    # A `sklearn` that fails to import, first on the path: as on a machine without scikit-learn.
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\")\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "limited_precision.py"), "--smoke"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        'limited_precision.py needs scikit-learn (its digits data set): pip install -e ".[examples]" '
        "(or pip install scikit-learn)"
    ]


def test_fp8_example_trains_both_and_reports_the_layers(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("torchao", reason="examples/fp8.py needs torchao (pip install 'amp_plugin[fp8]')")
    out, _ = example_run(request)
    assert out.count("fp8 (tensorwise): 7 of 9 Linear layers") == 1  # said once, by AMPPrecision
    assert "blocks.0.qkv (first Linear layer), head (last Linear layer)" in out
    bf16 = float(_summary_value(out, "bf16 final loss (mean of last 1)"))
    fp8 = float(_summary_value(out, "fp8 final loss (mean of last 1)"))
    assert abs(fp8 - bf16) <= 0.05 * bf16


def test_fp8_example_without_torchao_says_what_to_install(tmp_path: Path) -> None:
    # torchao blocked in sys.modules (import fails), as on a machine without it; the examples folder
    # first on sys.path, as `python examples/fp8.py` puts it.
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(EXAMPLES)!r}); sys.modules['torchao'] = None; "
        "sys.argv = ['fp8.py', '--smoke']; "
        f"runpy.run_path({str(EXAMPLES / 'fp8.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("fp8.py: AMPPrecision(fp8=") and "HINT: pip install" in lines[0]
