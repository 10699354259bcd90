"""Tests for ``amp_plugin.cli`` (`python -m amp_plugin`): doctor, model audit, JSON, exit codes, errors."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from amp_plugin import __version__
from amp_plugin.cli import load_model, main

ROOT = Path(__file__).resolve().parents[3]
NOT_CALLABLE = 3


def bad_model() -> nn.Module:
    """A model with fp16 hazards, one of them an error (a NaN parameter)."""
    model = nn.Sequential(nn.Linear(10, 60), nn.LayerNorm(60, eps=1e-12))
    model.register_buffer("mask", torch.full((4,), -1e9))
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    return model


def clean_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))


def not_a_model() -> dict[str, int]:
    return {"layers": 2}


def broken_factory() -> nn.Module:
    raise RuntimeError("checkpoint missing")


def exiting_factory() -> nn.Module:
    raise SystemExit(0)  # a factory that parses sys.argv, or ends a script, exits


def interrupted_factory() -> nn.Module:
    raise KeyboardInterrupt


def test_doctor_prints_the_report_and_recommends_what_auto_picks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("amp_plugin doctor")
    assert "matmul" not in out
    # bf16 on a CPU and on a CUDA device of compute capability >= 8.0, else fp16 (worked out here).
    bf16 = not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8
    assert f"recommended  precision='{'bf16-mixed' if bf16 else '16-mixed'}'" in out


def test_doctor_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-measure"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document) == {"device", "audit"} and document["audit"] is None
    assert document["device"]["recommended_precision"] in ("bf16-mixed", "16-mixed")


def test_doctor_ops_prints_the_probed_op_table_for_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-measure", "--ops"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("amp_plugin doctor")
    table = out[out.index("autocast ops:") :].splitlines()
    assert "cpu bfloat16" in table[2] and "cpu float16" in table[2]
    assert ("cuda float16" in table[2]) == torch.cuda.is_available()
    rows = {line.split()[0]: line.split()[1:] for line in table[3:]}
    assert rows["mm"][:4] == ["lower", "precision", "lower", "precision"]
    assert rows["mse_loss"][:2] == ["fp32", "fp32"]


def test_doctor_ops_json_holds_each_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-measure", "--ops"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document) == {"device", "audit", "ops"}
    probes = {(p["device"], p["dtype"]) for p in document["ops"]}
    assert {("cpu", "bfloat16"), ("cpu", "float16")} <= probes
    mm = next(r for r in document["ops"][0]["rows"] if r["op"] == "mm")
    assert mm["category"] == "lower precision"


def test_doctor_audits_a_bad_model_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-measure", "--model", "tests.unit.cli.test_cli:bad_model"]) == 1
    out = capsys.readouterr().out
    assert "Audit of Sequential: 1 error, 1 warning, 2 info notes" in out
    for code in ("nonfinite-values", "fp16-overflow", "norm-eps", "tensor-core-size"):
        assert code in out


def test_doctor_json_with_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-measure", "--model", "tests.unit.cli.test_cli:bad_model"]) == 1
    audit = json.loads(capsys.readouterr().out)["audit"]
    assert audit["ok"] is False and audit["counts"] == {"error": 1, "warning": 1, "info": 2}


def test_doctor_passes_a_clean_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-measure", "--model", "tests.unit.cli.test_cli:clean_model"]) == 0
    assert "No fp16 hazards found" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tests.unit.cli.test_cli", r"is not a factory spec; expected 'package.module:factory'"),
        ("tests.unit.cli.test_cli:", r"is not a factory spec"),
        ("no_such_package.models:build", r"importing 'no_such_package.models' failed \(ModuleNotFoundError"),
        ("tests.unit.cli.test_cli:missing", r"has no attribute 'missing'; expected a callable"),
        ("tests.unit.cli.test_cli:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not callable"),
        ("tests.unit.cli.test_cli:not_a_model",
         r"not_a_model\(\) returned a dict; expected a torch.nn.Module"),
        ("tests.unit.cli.test_cli:broken_factory", r"calling broken_factory\(\) raised RuntimeError"),
        ("tests.unit.cli.test_cli:exiting_factory", r"calling exiting_factory\(\) raised SystemExit: 0"),
    ],
)
def test_doctor_model_errors_exit_2_with_a_message(
    spec: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--no-measure", "--model", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"amp-plugin doctor: error: --model {spec!r}")
    assert "HINT:" in captured.err
    with pytest.raises((ValueError, TypeError, ImportError, RuntimeError), match=expected):
        load_model(spec)


def test_a_model_module_that_exits_at_import_exits_2_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "exits_at_import.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "--no-measure", "--model", "exits_at_import:build"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        "amp-plugin doctor: error: --model 'exits_at_import:build': importing 'exits_at_import' failed "
        "(SystemExit: 0)"
    )
    assert 'HINT: put its script part under `if __name__ == "__main__":`' in captured.err
    assert "exits_at_import" not in sys.modules


def test_an_interrupt_in_the_factory_is_not_turned_into_an_exit_status() -> None:
    with pytest.raises(KeyboardInterrupt):
        main(["doctor", "--no-measure", "--model", "tests.unit.cli.test_cli:interrupted_factory"])


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().err
    assert main(["doctor", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"amp_plugin {__version__}\n"


def test_version_after_the_subcommand_answers_too(capsys: pytest.CaptureFixture[str]) -> None:
    # It used to be an unknown option of doctor's, with the hint "did you mean --json?".
    assert main(["doctor", "--version"]) == 0
    assert capsys.readouterr().out == f"amp_plugin {__version__}\n"


def test_doctor_fp8_without_a_model_says_how_to_see_the_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert "0 of 0" not in out and "%" not in out
    assert "fp8 hardware: " in out and "HINT: add --model MODULE:FACTORY" in out
    assert main(["doctor", "--fp8", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["layers"] is None and document["recipe"] == "tensorwise"


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_doctor_fp8_with_a_model_prints_no_import_noise() -> None:
    # A fresh process: torchao's import-time warnings come only with its first import.
    command = [sys.executable, "-m", "amp_plugin", "doctor", "--fp8", "--model", "tests._fp8_models:TinyLM"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    assert "Failed to load" not in text and "register_constant" not in text, text
    assert "Linear layers" in result.stdout
    assert all(len(line) < 200 for line in text.splitlines()), text


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["doctor", "--jsn"], "HINT: did you mean --json?"),
        (["doctor", "--no-measure", "--modle=m:f"], "HINT: did you mean --model?"),
        (["doctor", "--frobnicate"], ""),
    ],
)
def test_a_mistyped_option_is_reported_by_its_subcommand(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: amp-plugin doctor ")  # the subcommand's usage, not the top level's
    wrong = argv[-1]
    assert f"amp-plugin doctor: error: unrecognized arguments: {wrong} (doctor does not know {wrong!r}" in err
    assert (
        "its options: -h/--help, --version, --model MODULE:FACTORY, --json, --no-measure, --ops, "
        "--fp8 RECIPE)" in err
    )
    assert hint in err and ("HINT" in err) == bool(hint)


def test_an_option_before_the_subcommand_is_the_top_levels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--jsn", "doctor"]) == 2
    assert "amp-plugin: error: unrecognized arguments: --jsn" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            "doctor",
            r"argv='doctor'\) is not allowed here: "
            r".*Allowed: None or a list of strings\. HINT: main\(\['doctor'\]\)",
        ),
        (["doctor", 1], r"argv=\['doctor', 1\]\) is not allowed here: .*Allowed: None or a list of strings"),
        (("doctor", b"--json"), r"argv=\('doctor', b'--json'\)\) is not allowed"),
    ],
)
def test_main_refuses_argv_that_is_not_a_list_of_strings(argv: object, match: str) -> None:
    # A plain string would be read one character per argument and fail as a usage error.
    with pytest.raises(TypeError, match=r"^main\(" + match):
        main(argv)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [None, 3, nn.Identity])
def test_load_model_refuses_a_spec_that_is_not_a_string(spec: object) -> None:
    with pytest.raises(
        TypeError,
        match=r"^load_model\(spec=.*\) is not allowed here: .*Allowed: a 'package\.module:factory' str.*HINT",
    ):
        load_model(spec)  # type: ignore[arg-type]


def test_load_model_accepts_a_class_and_dotted_attributes() -> None:
    assert isinstance(load_model("torch.nn:Identity"), nn.Identity)
    assert isinstance(load_model("torch:nn.Identity"), nn.Identity)


def test_console_script_points_at_main() -> None:
    try:
        importlib.metadata.distribution("amp-plugin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("amp-plugin is not installed (it runs from a source tree): no console scripts to check")
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="amp-plugin")
    assert entry.value == "amp_plugin.cli:main"
    assert entry.load() is main


def test_dunder_main_runs_the_cli() -> None:
    import amp_plugin.__main__ as dunder_main  # importing it runs nothing

    assert dunder_main.main is main


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "amp_plugin", "doctor", "--json", "--no-measure"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["device"]["versions"]["torch"] == torch.__version__


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_python_dash_m_version_and_a_mistyped_option() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "amp_plugin", *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)

    version = run("--version")
    assert (version.returncode, version.stdout) == (0, f"amp_plugin {__version__}\n"), version.stderr
    typo = run("doctor", "--jsn")
    assert typo.returncode == 2 and typo.stdout == ""
    assert "doctor does not know '--jsn'" in typo.stderr and "HINT: did you mean --json?" in typo.stderr
