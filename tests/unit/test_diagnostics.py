"""Forensics, optimizer set-up checks, model audit and device report (amp_plugin.diagnostics).

fp16 autocast on CPU is slow, so every model here is tiny.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import _imports, _tracer, diagnostics
from amp_plugin.autocast import resolve_precision
from amp_plugin.diagnostics import (
    NonFiniteTracer,
    audit_model,
    check_optimizer_setup,
    device_report,
    format_device_report,
    nonfinite_gradients,
)

# --------------------------------------------------------------------------- models


class Boost(nn.Module):
    """Multiplies by a constant: 1e5 overflows fp16 (max 65504) in forward."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _GradBoostFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e6


class GradBoost(nn.Module):
    """Identity in forward; multiplies the gradient by 1e6 in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradBoostFn.apply(x)


class Layer(nn.Module):
    def __init__(self, boost: nn.Module | None = None, inline_factor: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)  # the in-place case that breaks register_full_backward_hook
        self.boost = boost if boost is not None else Boost()
        self.out = nn.Linear(8, 8)
        self.inline_factor = inline_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.boost(self.lin(x)) * self.inline_factor))


class Net(nn.Module):
    def __init__(self, middle: Layer | None = None) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Layer(), middle or Layer(), Layer()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder.layers:
            x = layer(x)
        return self.head(x)


def _run(model: nn.Module, *, fp16: bool = True, loss_factor: float = 1.0, value: float = 30.0) -> None:
    """One forward (under fp16 autocast unless told otherwise) and backward on a constant batch."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(torch.full((2, 8), value))
    (out.float().sum() * loss_factor).backward()


# --------------------------------------------------------------------------- tracer


def test_tracer_names_the_module_that_overflows_in_forward() -> None:
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer:
        _run(model)
    record = tracer.forward_record
    assert record is not None
    assert (record.module, record.cls, record.dtype, record.kind, record.origin) == (
        "encoder.layers.1.boost",
        "Boost",
        torch.float16,
        "inf",
        "",
    )
    assert record.message().startswith("encoder.layers.1.boost (Boost, float16) produced inf in forward")
    assert 0 < record.largest_finite <= 65504
    assert "fp32_modules=(Boost,)" in record.hint() and "bf16" in record.hint()
    assert tracer.backward_record is None  # the forward overflow explains the backward that follows


def test_tracer_names_the_module_that_overflows_in_backward() -> None:
    model = Net(Layer(GradBoost()))
    with NonFiniteTracer(model) as tracer:
        _run(model, value=1.0)
    record = tracer.backward_record
    assert tracer.forward_record is None
    assert record is not None
    assert (record.module, record.cls, record.dtype, record.origin) == (
        "encoder.layers.1.boost",
        "GradBoost",
        torch.float16,
        "",
    )
    assert record.what == "gradient w.r.t. its input"
    assert "produced inf in backward" in record.message()
    assert "init_scale" in record.hint()
    report = tracer.report()
    assert report is not None and report.startswith(record.message())


def test_tracer_blames_code_between_submodules() -> None:
    model = Net(Layer(inline_factor=1e5))  # the multiply sits in Layer.forward, not in a submodule
    with NonFiniteTracer(model) as tracer:
        _run(model)
    record = tracer.forward_record
    assert record is not None
    assert record.module == "encoder.layers.1.act"
    assert record.origin == "code in encoder.layers.1 that runs before it"
    assert "first reached encoder.layers.1.act (ReLU, float16) in its input" in record.message()


def test_tracer_blames_the_loss_for_an_overflowing_output_gradient() -> None:
    model = Net()
    with NonFiniteTracer(model) as tracer:
        _run(model, fp16=False, loss_factor=1e38 * 1e38)
    record = tracer.backward_record
    assert record is not None
    assert (record.module, record.origin) == ("<Net>", "the loss (code after the model)")
    assert "precision is not the cause" in record.hint()  # float32 overflow


def test_tracer_names_a_parameter_gradient_that_overflows() -> None:
    # The input needs no gradient, so the only fp16 overflow is the weight gradient x^T @ grad_out.
    model = nn.Sequential(nn.Linear(8, 8))
    with NonFiniteTracer(model) as tracer:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((64, 8), 300.0))
        (out.float().sum() * 100).backward()
    record = tracer.backward_record
    assert record is not None
    assert (record.module, record.what, record.dtype) == (
        "0",
        "gradient of its parameter 'weight'",
        torch.float16,
    )


def test_tracer_leaves_gradients_unchanged_and_inplace_modules_working() -> None:
    model = Net()
    _run(model)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with NonFiniteTracer(model) as tracer:
        _run(model)
    assert tracer.report() is None
    for p, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


def _hook_count(model: nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    return count + sum(len(p._backward_hooks or {}) for p in model.parameters())


def test_detach_removes_every_hook_and_attach_is_idempotent() -> None:
    model = Net(Layer(Boost(1e5)))
    tracer = NonFiniteTracer(model)
    assert _hook_count(model) == 0 and not tracer.attached
    tracer.attach()
    first = _hook_count(model)
    tracer.attach()
    assert _hook_count(model) == first > 0
    tracer.detach()
    assert _hook_count(model) == 0 and not tracer.attached
    _run(model)
    assert tracer.report() is None  # detached: nothing recorded


def test_no_hook_outlives_detach_when_modules_pass_parameters_around() -> None:
    class Positions(nn.Module):  # returns its own parameter: a leaf tensor as a module output
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(2, 8))

        def forward(self) -> torch.Tensor:
            return self.table

    class WithPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = Positions()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x + self.pos()) + self.lin(self.pos.table)  # a parameter as an input too

    model = WithPositions()
    with NonFiniteTracer(model):
        for _ in range(3):
            model(torch.ones(2, 8)).sum().backward()
    assert _hook_count(model) == 0


def test_checks_stop_after_the_first_record_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _tracer._is_nonfinite
    monkeypatch.setattr(_tracer, "_is_nonfinite", lambda t: calls.append(1) or real(t))
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer:
        _run(model)
        assert tracer.forward_record is not None and calls
        calls.clear()
        _run(model)
        assert not calls  # recorded: no more checks, no more host syncs
        tracer.reset()
        assert tracer.forward_record is None
        _run(model)
        assert tracer.forward_record is not None and calls


def test_tracer_checks_forward_under_no_grad() -> None:
    model = Net(Layer(Boost(1e5)))
    with NonFiniteTracer(model) as tracer, torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), 30.0))
    assert tracer.forward_record is not None and tracer.forward_record.module == "encoder.layers.1.boost"


def test_tracer_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"NonFiniteTracer\(model=list\).*HINT"):
        NonFiniteTracer([nn.Linear(2, 2)])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- nonfinite_gradients


def test_nonfinite_gradients_names_the_poisoned_parameter() -> None:
    model = Net()
    _run(model, fp16=False)
    model.encoder.layers[1].out.weight.grad[3, 4] = float("nan")
    found = nonfinite_gradients(model.named_parameters())
    assert [(g.name, g.kind, g.count) for g in found] == [("encoder.layers.1.out.weight", "nan", 1)]
    assert str(found[0]) == "encoder.layers.1.out.weight (nan in 1 of 64 values, float32)"


def test_nonfinite_gradients_kinds_order_limit_and_missing_grads() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    model[0].bias.grad = None
    model[1].weight.grad[0] = torch.tensor([float("inf"), float("nan")])
    model[2].bias.grad[1] = float("-inf")
    model[2].weight.grad.fill_(3e38)  # huge but finite: its 1-norm overflows
    found = nonfinite_gradients(model)
    assert [(g.name, g.kind) for g in found] == [("1.weight", "inf and nan"), ("2.bias", "inf")]
    assert [g.name for g in nonfinite_gradients(model, limit=1)] == ["1.weight"]
    model.zero_grad()
    assert nonfinite_gradients(model) == []


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [
        (0, ValueError, r"limit=0\) is not allowed: an int >= 1"),
        (-1, ValueError, r"limit=-1\) is not allowed: an int >= 1"),
        (2.5, TypeError, r"limit=2.5\) is not allowed: an int >= 1"),
        (True, TypeError, r"limit=True\) is not allowed: an int >= 1"),
        ("5", TypeError, r"limit='5'\) is not allowed: an int >= 1"),
    ],
)
def test_nonfinite_gradients_rejects_a_bad_limit(limit: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=r"^nonfinite_gradients\(" + match + r"\. HINT: pass limit=5"):
        nonfinite_gradients(nn.Linear(2, 2), limit=limit)


@pytest.mark.parametrize(
    ("named", "match"),
    [
        (lambda m: m.parameters(), r"named_parameters=.*\(name, parameter\) pairs.*"
         r"HINT: pass model\.named_parameters"),
        (lambda m: "weight", r"named_parameters='weight'\) is not allowed"),
        (lambda m: [("weight", 1.0)], r"named_parameters=\.\.\.\) is not allowed: .*pairs; "
         r"got tuple \('weight', 1\.0\)"),
        (lambda m: 3, r"named_parameters=3\) is not allowed"),
    ],
)  # fmt: skip
def test_nonfinite_gradients_refuses_what_is_not_named_parameters(named: Any, match: str) -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad[0] = float("nan")  # unnamed parameters would silently report nothing
    with pytest.raises(TypeError, match=r"^nonfinite_gradients\(" + match):
        nonfinite_gradients(named(model))


# --------------------------------------------------------------------------- check_optimizer_setup


def _codes(findings: list[diagnostics.Finding]) -> list[tuple[str, str]]:
    return [(f.severity, f.code) for f in findings]


def test_fp16_parameters_under_loss_scaling_are_an_error_named_like_torch_fails() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    findings = check_optimizer_setup(model, [opt], device_type="cpu", dtype=torch.float16)
    assert _codes(findings) == [("error", "fp16-params")]
    assert findings[0].where == ("1.weight", "1.bias")
    assert "Attempting to unscale FP16 gradients" in findings[0].message and "HINT" in findings[0].message
    # The oracle: torch itself fails on this set-up, later and without naming anything.
    model[1].weight.grad = torch.ones_like(model[1].weight)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_half_parameters_without_scaling_or_with_master_weights() -> None:
    model = nn.Linear(4, 4).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert (
        check_optimizer_setup(model, opt, device_type="cpu", dtype=torch.float16, master_weights=True) == []
    )
    findings = check_optimizer_setup(model, opt, device_type="cpu", dtype=torch.float16, grad_scaling=False)
    assert _codes(findings) == [("warning", "half-params")]
    model.bfloat16()
    assert _codes(check_optimizer_setup(model, opt, device_type="cpu", dtype=torch.bfloat16)) == [
        ("warning", "half-params")
    ]


def test_optimizer_without_trainable_parameters_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].requires_grad_(False)
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    findings = check_optimizer_setup(model, opts, device_type="cpu", dtype=torch.bfloat16)
    assert _codes(findings) == [("error", "no-trainable-params")]
    assert findings[0].message.startswith("optimizer 1 (SGD)") and "No inf checks" in findings[0].message


def test_parameters_outside_autocast_device_and_outside_the_model_are_warnings() -> None:
    model = nn.Linear(4, 4)
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    findings = check_optimizer_setup(model, opt, device_type="cuda", dtype=torch.float16)
    assert _codes(findings) == [("warning", "device-not-autocast"), ("warning", "params-not-in-model")]
    assert (
        findings[0].where[:2] == ("weight", "bias") and "autocast runs for 'cuda' only" in findings[0].message
    )
    assert "shape [3]" in findings[1].message


def test_a_clean_setup_has_no_findings_and_wrappers_are_unwrapped() -> None:
    class Wrapper:  # what LightningOptimizer looks like from here
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self._optimizer = optimizer

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    assert check_optimizer_setup(model, [Wrapper(opt)], device_type="cpu", dtype=torch.float16) == []
    assert check_optimizer_setup(model, Wrapper(opt), device_type="cpu", dtype=torch.float16) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": [1]}, TypeError, r"model=list\) is not allowed: a torch\.nn\.Module.*HINT"),
        ({"device_type": "gpu"}, ValueError, r"device_type='gpu'.*HINT: 'gpu' is Lightning's accelerator"),
        ({"device_type": ""}, ValueError, r"device_type=''\) is not allowed.*HINT"),
        ({"device_type": None}, TypeError, r"device_type=None\) is not allowed: a str or torch\.device"),
        ({"device_type": "meta"}, ValueError, r"device_type='meta'\) is not allowed: autocast is not"),
        ({"dtype": torch.float32}, ValueError, r"dtype=torch.float32\) is not allowed: torch.float16 or "
         r"torch.bfloat16.*HINT"),
        ({"dtype": "fp16"}, TypeError, r"dtype='fp16'\) is not allowed: torch.float16 or torch.bfloat16.*"
         r"HINT: pass the torch.dtype, e.g. torch.float16"),
        ({"dtype": None}, TypeError, r"dtype=None\) is not allowed"),
        ({"master_weights": "False"}, TypeError, r"master_weights='False'\) is not allowed: a bool"),
        ({"grad_scaling": "yes"}, TypeError, r"grad_scaling='yes'\) is not allowed: None or a bool"),
        ({"grad_scaling": 1}, TypeError, r"grad_scaling=1\) is not allowed: None or a bool"),
        ({"optimizers": [object()]}, TypeError, r" a torch\.optim\.Optimizer.*got object.*HINT"),
    ],
)  # fmt: skip
def test_check_optimizer_setup_rejects_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    model = nn.Linear(2, 2)
    args: dict[str, Any] = {
        "model": model,
        "optimizers": torch.optim.SGD(model.parameters(), lr=0.1),
        "device_type": "cpu",
        "dtype": torch.float16,
        **kwargs,
    }
    with pytest.raises(error, match=r"^(check_optimizer_setup\(|Expected)" + match):
        check_optimizer_setup(args.pop("model"), args.pop("optimizers"), **args)


@pytest.mark.parametrize("device", ["cuda:0", torch.device("cpu"), torch.device("cuda", 1)])
def test_check_optimizer_setup_takes_the_type_of_a_device(device: Any) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    findings = check_optimizer_setup(model, opt, device_type=device, dtype=torch.bfloat16)
    on_cpu = torch.device(device).type == "cpu"
    assert _codes(findings) == ([] if on_cpu else [("warning", "device-not-autocast")])


# --------------------------------------------------------------------------- audit_model


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
    assert table.splitlines()[0] == "Audit of BadModel: 1 error, 5 warning, 3 info"
    assert "SEVERITY" in table and "nonfinite-values" in table and "HINT" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["model"] == "BadModel"
    assert {"severity", "code", "message", "where"} == set(data["findings"][0])


def test_audit_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"audit_model\(model=str\).*HINT"):
        audit_model("model")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- device report


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


@pytest.mark.parametrize(
    ("width", "error"), [(0, ValueError), (19, ValueError), ("100", TypeError), (True, TypeError)]
)
def test_audit_report_format_rejects_a_bad_width(width: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^AuditReport.format\(width={width!r}\) is not allowed: an int >= 20"):
        audit_model(nn.Linear(3, 8)).format(width)
