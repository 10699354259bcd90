"""Tests for ``amp_plugin.diagnostics.device_report``: what this machine supports, and the doctor's text."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from amp_plugin import _imports
from amp_plugin.diagnostics.device_report import device_report, format_device_report
from amp_plugin.precision import resolve_precision


def test_device_report_without_measurement() -> None:
    report = device_report(measure=False)
    assert set(report) == {
        "versions",
        "cpu",
        "cuda",
        "apex",
        "throughput_tflops",
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
    assert "matmul       cpu: float32" in text and "TFLOP/s" in text


def test_format_device_report_names_the_recommendation() -> None:
    report = device_report(measure=False)
    text = format_device_report(report)
    assert text.splitlines()[0] == "amp_plugin doctor"
    assert f"recommended  precision={report['recommended_precision']!r}" in text
    assert "apex amp_C" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget_s": 0}, ValueError, r"budget_s=0\) is not allowed: a finite number > 0"),
        ({"budget_s": -1.0}, ValueError, r"budget_s=-1.0\) is not allowed: a finite number > 0"),
        ({"budget_s": float("nan")}, ValueError, r"budget_s=nan\) is not allowed: a finite number > 0"),
        ({"budget_s": float("inf")}, ValueError, r"budget_s=inf\) is not allowed: a finite number > 0"),
        ({"budget_s": "1"}, TypeError, r"budget_s='1'\) is not allowed: a finite number > 0"),
        ({"budget_s": True}, TypeError, r"budget_s=True\) is not allowed: a finite number > 0"),
        ({"measure": "no"}, TypeError, r"measure='no'\) is not allowed: a bool"),
        ({"measure": 0}, TypeError, r"measure=0\) is not allowed: a bool"),
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
