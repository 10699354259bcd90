"""Tests for ``amp_plugin.diagnostics._optimizer_check``: set-ups that would fail at fit start."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.diagnostics._audit import Finding
from amp_plugin.diagnostics._optimizer_check import check_optimizer_setup


def _codes(findings: list[Finding]) -> list[tuple[str, str]]:
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
        ({"model": [1]}, TypeError, r"model=list\) is not allowed here: .*a torch\.nn\.Module.*HINT"),
        ({"device_type": "gpu"}, ValueError, r"device_type='gpu'.*HINT: 'gpu' is Lightning's accelerator"),
        ({"device_type": ""}, ValueError, r"device_type=''\) is not allowed.*HINT"),
        ({"device_type": None}, TypeError, r"device_type=None\) is not allowed here: "
            r".*a str or torch\.device"),
        ({"device_type": "meta"}, ValueError, r"device_type='meta'\) is not allowed here: .*autocast is not"),
        ({"dtype": torch.float32}, ValueError, r"dtype=torch.float32\) is not allowed here: "
            r".*torch.float16 or "
         r"torch.bfloat16.*HINT"),
        ({"dtype": "fp16"}, TypeError, r"dtype='fp16'\) is not allowed here: "
            r".*torch.float16 or torch.bfloat16.*"
         r"HINT: pass the torch.dtype, e.g. torch.float16"),
        ({"dtype": None}, TypeError, r"dtype=None\) is not allowed"),
        ({"master_weights": "False"}, TypeError, r"master_weights='False'\) is not allowed here: .*a bool"),
        ({"grad_scaling": "yes"}, TypeError, r"grad_scaling='yes'\) is not allowed here: .*None or a bool"),
        ({"grad_scaling": 1}, TypeError, r"grad_scaling=1\) is not allowed here: .*None or a bool"),
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
