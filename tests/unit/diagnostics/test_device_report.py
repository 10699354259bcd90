"""Tests for ``amp_plugin.diagnostics._device_report``: what this machine supports, and the doctor's text."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import torch

from amp_plugin import _imports
from amp_plugin.diagnostics._device_report import device_report, format_device_report
from amp_plugin.precision import resolve_precision

_MODULE = importlib.import_module(
    "amp_plugin.diagnostics._device_report"
)  # the package re-exports a function of that name


def test_device_report_without_measurement() -> None:
    report = device_report(measure=False)
    assert set(report) == {
        "versions",
        "cpu",
        "cuda",
        "apex",
        "throughput_tflops",
        "throughput_spread",
        "matmul_setup",
        "small_matmul",
        "notes",
        "recommended_precision",
        "reason",
    }
    assert report["versions"]["torch"] == torch.__version__
    assert report["throughput_tflops"] is None
    assert report["cpu"]["bf16_autocast"] is True
    assert report["apex"] == {"available": _imports.apex_available(), "reason": _imports.apex_error()}
    assert report["cuda"]["available"] == torch.cuda.is_available()
    json.dumps(report)
    # It must agree with AMPPrecision(precision="auto") on the device Lightning would use.
    auto = resolve_precision("auto", "cuda" if torch.cuda.is_available() else "cpu")
    assert report["recommended_precision"] == {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}[auto]
    if not torch.cuda.is_available():
        assert report["recommended_precision"] == "bf16-mixed" and "bf16" in report["reason"]


def test_device_report_measures_matmul_throughput_within_budget() -> None:
    report = device_report(budget_s=0.02)
    rates = report["throughput_tflops"]["cpu"]
    assert set(rates) == {"float32", "bfloat16", "float16"}
    assert rates["float32"] > 0
    text = format_device_report(report)
    assert max(len(line) for line in text.splitlines()) <= 88  # wrapped to fit a terminal or a page
    words = " ".join(text.split())
    assert "matmul cpu, 256x256, 1 thread, median (min-max) of 5 runs, TFLOP/s: float32" in words
    assert "TFLOP/s" in text


def test_the_matmul_timings_run_on_one_thread_and_report_their_spread() -> None:
    threads = torch.get_num_threads()
    report = device_report(budget_s=0.02)
    assert torch.get_num_threads() == threads  # restored
    assert (
        report["matmul_setup"] == {"sizes": {"cpu": 256}, "runs": 5, "cpu_threads": 1}
        or torch.cuda.is_available()
    )
    for dtype, median in report["throughput_tflops"]["cpu"].items():
        if median is not None:
            low, high = report["throughput_spread"]["cpu"][dtype]
            assert low <= median <= high
    assert report["small_matmul"]["size"] == 64 and report["small_matmul"]["float32"] > 0
    json.dumps(report)


def _timed(monkeypatch: pytest.MonkeyPatch, rates: dict[tuple[int, str], float]) -> str:
    """The doctor's text where each (matmul side, dtype) ran at the given TFLOP/s."""

    def runs(device: torch.device, dtype: torch.dtype, n: int, budget_s: float) -> list[float]:
        rate = rates[n, str(dtype).removeprefix("torch.")]
        return [rate * 0.9, rate, rate * 1.1]

    monkeypatch.setattr(_MODULE, "_matmul_runs", runs)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    return " ".join(format_device_report(device_report()).split())  # the words, whatever the wrapping


def test_fp16_far_slower_than_bf16_reads_native_fp16_no_and_small_bf16_slower_than_fp32_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_MODULE, "native_on_cpu", lambda dtype: True)
    text = _timed(monkeypatch, {(256, "float32"): 0.08, (256, "bfloat16"): 0.37, (256, "float16"): 0.003,
                                (64, "float32"): 0.05, (64, "bfloat16"): 0.025})  # fmt: skip
    assert "bf16 autocast: yes, native bf16: yes, native fp16: no cuda" in text
    assert "note native fp16: no. fp16 matmuls ran 123x slower than bf16 here" in text
    assert "small models are slower in bf16 on this CPU: a 64x64 matmul ran at 0.50x fp32 in bf16" in text
    assert "float32 0.08 (0.072-0.088)" in text


def test_a_cpu_with_fast_fp16_and_bf16_gets_no_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_MODULE, "native_on_cpu", lambda dtype: True)
    text = _timed(monkeypatch, {(256, "float32"): 0.2, (256, "bfloat16"): 0.8, (256, "float16"): 0.7,
                                (64, "float32"): 0.05, (64, "bfloat16"): 0.1})  # fmt: skip
    assert "native fp16: yes" in text and "note " not in text


def test_format_device_report_names_the_recommendation() -> None:
    report = device_report(measure=False)
    text = format_device_report(report)
    assert text.splitlines()[0] == "amp_plugin doctor"
    assert f"recommended  precision={report['recommended_precision']!r}" in text
    assert "apex amp_C" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget_s": 0}, ValueError, r"budget_s=0\) is not allowed here: .*a finite number > 0"),
        ({"budget_s": -1.0}, ValueError, r"budget_s=-1.0\) is not allowed here: .*a finite number > 0"),
        ({"budget_s": float("nan")}, ValueError, r"budget_s=nan\) is not allowed here: "
            r".*a finite number > 0"),
        ({"budget_s": float("inf")}, ValueError, r"budget_s=inf\) is not allowed here: "
            r".*a finite number > 0"),
        ({"budget_s": "1"}, TypeError, r"budget_s='1'\) is not allowed here: .*a finite number > 0"),
        ({"budget_s": True}, TypeError, r"budget_s=True\) is not allowed here: .*a finite number > 0"),
        ({"measure": "no"}, TypeError, r"measure='no'\) is not allowed here: .*a bool"),
        ({"measure": 0}, TypeError, r"measure=0\) is not allowed here: .*a bool"),
    ],
)
def test_device_report_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^device_report\(" + match + r".*HINT"):
        device_report(**kwargs)


@pytest.mark.parametrize(
    ("report", "match"), [("report", r"report=str"), ({"cpu": {}}, r"report=dict.*keys")]
)
def test_format_device_report_refuses_what_device_report_did_not_make(report: Any, match: str) -> None:
    with pytest.raises(
        TypeError, match=r"^format_device_report\(" + match + r".*HINT: pass device_report\(\)"
    ):
        format_device_report(report)
