"""Tests for ``amp_plugin.diagnostics._audit``: fp16 hazards found in a model without running it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.diagnostics._audit import audit_model


class HandRMSNorm(nn.Module):
    """Computes its statistics in whatever dtype arrives: fp16 under autocast on CPU."""

    def __init__(self, dim: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class UpcastRMSNorm(HandRMSNorm):
    """Upcasts itself (the Llama recipe), so autocast cannot hurt it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class TalkingRMSNorm(HandRMSNorm):
    """Mentions x.float() and torch.float32 only in words, so it still computes in fp16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x.float() would be safer
        note = "autocast(...) or .double() would help"  # noqa: F841
        return x / x.std(-1, keepdim=True)  # .to(torch.float32) first


class BadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1001, 64)
        self.proj = nn.Linear(64, 60)
        self.ln = nn.LayerNorm(60, eps=1e-12)
        self.norm = HandRMSNorm(60)
        self.good_norm = UpcastRMSNorm(60)
        self.loss = nn.BCELoss()
        self.half_head = nn.Linear(8, 8).half()
        self.broken = nn.Parameter(torch.tensor([1.0, float("nan")]))
        self.register_buffer("mask", torch.full((4,), -1e9))
        self.register_buffer("causal", torch.full((4,), float("-inf")))  # fine in fp16
        self.register_buffer("tiny", torch.full((4,), 1e-10))


def test_audit_flags_each_hazard_of_a_bad_model() -> None:
    report = audit_model(BadModel())
    got = {(f.severity, f.code, f.where[0]) for f in report.findings if f.code != "fp16-params"}
    assert got == {
        ("error", "nonfinite-values", "broken"),
        ("warning", "custom-norm", "norm"),
        ("warning", "bce-loss", "loss"),
        ("warning", "fp16-overflow", "mask"),
        ("warning", "fp16-underflow", "tiny"),
        ("info", "norm-eps", "ln"),
        ("info", "tensor-core-size", "embed"),
        ("info", "tensor-core-size", "proj"),
    }
    half = [f for f in report.findings if f.code == "fp16-params"]
    assert [(f.severity, f.where) for f in half] == [("warning", ("half_head.weight", "half_head.bias"))]
    assert not report.ok and report.counts() == {"error": 1, "warning": 5, "info": 3}
    assert [f.severity for f in report.findings] == sorted(
        (f.severity for f in report.findings), key=["error", "warning", "info"].index
    )
    norm = next(f for f in report.findings if f.code == "custom-norm")
    assert "eps=1e-08" in norm.message and "fp32_modules=(HandRMSNorm,)" in norm.message


def test_a_norm_that_mentions_upcasting_only_in_comments_and_strings_is_flagged() -> None:
    assert [f.code for f in audit_model(TalkingRMSNorm(8)).findings] == ["custom-norm"]
    assert audit_model(UpcastRMSNorm(8)).findings == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp16_overflow_flags_exactly_the_values_fp16_rounds_to_inf(dtype: torch.dtype) -> None:
    values = [65504.0, 65510.0, 65519.99, -65519.99, 65520.0, -65520.0, 70000.0, 1.0]
    model = nn.Module()
    model.register_buffer("big", torch.tensor(values, dtype=dtype))
    becomes_inf = int(model.big.half().isinf().sum())
    assert becomes_inf == 3
    findings = audit_model(model).findings
    assert [f.code for f in findings] == ["fp16-overflow"]
    assert f"holds {becomes_inf} value(s) with |x| up to 7e+04 >= 65520" in findings[0].message
    model.big = torch.tensor(values[:4], dtype=dtype)  # they round to 65504: finite in fp16
    assert not model.big.half().isinf().any() and audit_model(model).findings == ()


def test_audit_passes_a_clean_model() -> None:
    clean = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))
    report = audit_model(clean)
    assert report.findings == () and report.ok
    assert "No fp16 hazards found" in report.format()


def test_audit_claims_hold_numerically() -> None:
    # Hand-written norm under fp16 autocast on CPU: eps=1e-8 vanishes and a constant row divides 0 by 0.
    x = torch.zeros(2, 60)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isnan(HandRMSNorm(60)(nn.Identity()(x).half())).all()
    # torch's LayerNorm adds eps in fp32 even for fp16 tensors: eps=1e-12 stays harmless.
    assert torch.isfinite(nn.LayerNorm(60, eps=1e-12).half()(x.half())).all()
    assert torch.isinf(torch.tensor(-1e9).half())
    assert torch.tensor(1e-10).half() == 0


def test_audit_report_table_and_json() -> None:
    report = audit_model(BadModel())
    table = report.format()
    assert table.splitlines()[0] == "Audit of BadModel: 1 error, 5 warnings, 3 info notes"
    assert "SEVERITY" in table and "nonfinite-values" in table and "HINT" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["model"] == "BadModel"
    assert {"severity", "code", "message", "where"} == set(data["findings"][0])


def test_audit_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"audit_model\(model=str\).*HINT"):
        audit_model("model")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("width", "error"), [(0, ValueError), (19, ValueError), ("100", TypeError), (True, TypeError)]
)
def test_audit_report_format_rejects_a_bad_width(width: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^AuditReport.format\(width={width!r}\) is not allowed here: "
        rf".*an int >= 20"):
        audit_model(nn.Linear(3, 8)).format(width)


def test_fp16_underflow_counts_only_values_fp16_rounds_to_zero() -> None:
    class Small(nn.Module):
        def __init__(self, value: float) -> None:
            super().__init__()
            self.register_buffer("small", torch.full((8,), value))

    for value in (2.0**-25, 1e-10):  # 2**-25 ties to 0
        assert float(torch.tensor(value).half()) == 0.0
        assert any(f.code == "fp16-underflow" for f in audit_model(Small(value)).findings)
    value = 4e-8  # between 2**-25 and 2**-24: fp16 rounds it up to 2**-24
    assert float(torch.tensor(value).half()) == 2.0**-24
    assert not any(f.code == "fp16-underflow" for f in audit_model(Small(value)).findings)
