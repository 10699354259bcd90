"""``amp_plugin.diagnostics._fp8_report`` and ``python -m amp_plugin doctor --fp8``.

The fp8 error is checked against an independent emulation: both operands scaled to the e4m3
range by their absolute maximum, cast to ``torch.float8_e4m3fn`` and back, multiplied in fp64.
"""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # its CUDA extensions cannot load on CPU

import pytest
import torch
from torch import nn

from amp_plugin import _imports
from amp_plugin.cli import main
from amp_plugin.diagnostics import _fp8_report as doctor
from amp_plugin.fp8 import Float8, float8_layer_names, select_layers
from tests._fp8_models import TinyLM, batches
from tests._torch_features import ROWWISE_ON_CPU_REASON, cpu_rowwise_scaled_mm

needs_torchao = pytest.mark.skipif(
    _imports.torchao_error() is not None, reason=f"needs torchao 0.18 ({_imports.torchao_error()})"
)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _hardware_line() -> str:
    """The report's hardware line on this machine, worked out here from what torch says of the GPU."""
    if not torch.cuda.is_available():
        return "fp8 hardware: no: CPU only"
    has = torch.cuda.get_device_capability() >= (8, 9)  # Ada, Hopper and later have fp8 tensor cores
    return f"fp8 hardware: {'yes' if has else 'no'}: {torch.cuda.get_device_name()}"


def _emulated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    def cast(t: torch.Tensor) -> torch.Tensor:
        scale = E4M3_MAX / t.abs().max().double()
        return (t.double() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() / scale

    return cast(x) @ cast(w).T


def test_sqnr_is_the_fp64_ratio() -> None:
    ref, noisy = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])
    assert doctor.sqnr_db(ref, noisy) == pytest.approx(10 * math.log10(25 / 0.25))
    assert doctor.sqnr_db(ref, ref) == math.inf


def test_hardware_line_follows_the_cuda_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    has, why = doctor.fp8_hardware()
    assert not has and why.startswith("no: CPU only")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU X")
    for capability, expected in (((9, 0), True), ((8, 9), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda c=capability: c)
        assert doctor.fp8_hardware()[0] is expected


@needs_torchao
def test_output_error_matches_an_independent_fp8_emulation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    report = doctor.fp8_report(model, Float8(min_features=64), rows=128, seed=3)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(3))  # the report's first draw
    weight = model[0].weight.detach()
    expected = doctor.sqnr_db(x.double() @ weight.double().T, _emulated(x, weight))
    assert report["layers"][0]["output_sqnr_db"] == pytest.approx(expected, abs=0.5)
    assert 20 < expected < 40  # e4m3 keeps 3 mantissa bits: roughly 30 dB


@needs_torchao
def test_report_lists_every_linear_and_changes_nothing() -> None:
    model = TinyLM()
    model.head = nn.Linear(64, 90)  # odd: listed, not measured
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ((tokens, _),) = batches(1)
    report = doctor.fp8_report(model, Float8(min_features=64), inputs=tokens)
    choice = select_layers(model, Float8(min_features=64))
    assert [layer["name"] for layer in report["layers"] if layer["converted"]] == list(choice.converted_names)
    assert len(report["layers"]) == 9
    head = report["layers"][-1]
    assert (head["name"], head["output_sqnr_db"], head["reason"]) == (
        "head",
        None,
        "dims 64x90 not multiples of 16",
    )
    assert all(layer["output_sqnr_db"] > 15 for layer in report["layers"][:-1])
    assert float8_layer_names(model) == ()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _hardware_line() in doctor.format_fp8_report(report)


@needs_torchao
def test_doctor_fp8_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--fp8", "--model", "tests._fp8_models:TinyLM"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fp8 (recipe tensorwise)\n  {_hardware_line()}")
    assert "smaller than min_features=1024" in out  # the default rule: TinyLM is too small to gain
    if not cpu_rowwise_scaled_mm():
        pytest.skip(ROWWISE_ON_CPU_REASON)
    assert main(["doctor", "--fp8", "rowwise", "--json", "--model", "tests._fp8_models:TinyLM"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["recipe"] == "rowwise" and len(document["layers"]) == 9


def test_doctor_fp8_refuses_an_unknown_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--fp8", "blockwise"]) == 2
    assert "invalid choice: 'blockwise'" in capsys.readouterr().err
