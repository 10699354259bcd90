"""Tests for ``amp_plugin.precision``: precision strings, device types, what "auto" picks."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.autocast import autocast_state
from amp_plugin.precision import auto_precision_reason, check_device, check_precision, resolve_precision

# ---------------------------------------------------------------- precision strings


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
def test_resolve_precision_explicit_strings_on_cpu(precision: str, dtype: torch.dtype) -> None:
    assert resolve_precision(precision, "cpu") == dtype


def test_auto_picks_bf16_on_cpu_and_says_why() -> None:
    assert resolve_precision("auto", "cpu") == torch.bfloat16
    assert auto_precision_reason("cpu") == "bf16: CPU autocast supports bf16"


def test_fp16_on_cpu_is_honoured() -> None:
    # Lightning turns "16-mixed" into bf16 on CPU (with a warning, Lightning 2.6); we must not.
    dtype = resolve_precision("16-mixed", "cpu")
    with torch.autocast("cpu", dtype=dtype):
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.float16


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("16-true", torch.float16), ("bf16-true", torch.bfloat16), ("32-true", torch.float32)],
)
def test_true_precisions_name_the_weight_dtype(precision: str, dtype: torch.dtype) -> None:
    assert resolve_precision(precision, "cpu") == dtype


@pytest.mark.parametrize(
    ("precision", "match"),
    [
        ("16", r"^resolve_precision\(precision='16'\) is not allowed here: .*one of .*HINT: use '16-mixed'"),
        (16, r"^resolve_precision\(precision=16\) is not allowed here: .*.*HINT: use '16-mixed'"),
        ("fp16", r"HINT: use '16-mixed'"),
        (torch.float16, r"HINT: use '16-mixed'"),
        ("bf16", r"HINT: use 'bf16-mixed'"),
        ("32", r"HINT: use '32-true'"),
        ("64-true", r"HINT: for fp64 drop the AMP plugin"),
        (
            "mixed",
            r"Allowed: one of '16-mixed', 'bf16-mixed', 'auto', '16-true', 'bf16-true', '32-true'\. "
            r"HINT: pick one",
        ),
        (None, r"\(precision=None\) is not allowed"),
    ],
)
def test_resolve_precision_rejects_unknown_strings(precision: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_precision(precision, "cpu")


# ---------------------------------------------------------------- device types


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda"),  # an index is harmless where a device type is wanted
        (torch.device("cuda", 1), "cuda"),
        (torch.device("cpu"), "cpu"),
        ("mps", "mps"),
    ],
)
def test_check_device_returns_the_device_type(device: object, expected: str) -> None:
    assert check_device(device, "AMPPrecision") == expected


BAD_DEVICES: list[tuple[object, type[Exception], str]] = [
    ("gpu", ValueError, r"'gpu' is Lightning's accelerator name; the device type is 'cuda'"),
    ("tpu", ValueError, r"'tpu' is Lightning's accelerator name; the device type is 'xla'"),
    ("auto", ValueError, r"HINT: 'auto' is Lightning's accelerator choice, not a device type"),
    ("", ValueError, r"=''\) is not allowed.*HINT: pass a device type such as 'cuda' or 'cpu'"),
    ("CUDA", ValueError, r"HINT: device types are lowercase: 'cuda'"),
    (
        "cuda:x",
        ValueError,
        r"='cuda:x'\) is not allowed here: .*a device type with autocast: .*"
        r"HINT: write the device type alone, e\.g\. 'cuda'",
    ),
    ("meta", ValueError, r"not available for device type 'meta'.*HINT: pass a device type"),
    (torch.device("meta"), ValueError, r"not available for device type 'meta'"),
    (0, TypeError, r"=0\) is not allowed here: .*a str or torch\.device.*HINT: 0 looks like a CUDA index"),
    (None, TypeError, r"=None\) is not allowed here: .*a str or torch\.device.*HINT: pass a device type"),
    (["cuda"], TypeError, r"=\['cuda'\]\) is not allowed.*HINT"),
]


@pytest.mark.parametrize(("device", "error", "match"), BAD_DEVICES)
def test_check_device_rejects_what_is_not_a_device_type(
    device: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^AMPPrecision\(device.*" + match) as info:
        check_device(device, "AMPPrecision")
    assert "'cpu', 'cuda'" in str(info.value)  # the allowed types are listed


@pytest.mark.parametrize(("device", "error", "match"), BAD_DEVICES)
def test_every_device_type_argument_uses_check_device(
    device: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^resolve_precision\(device_type.*" + match):
        resolve_precision("bf16-mixed", device)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"^auto_precision_reason\(device_type.*" + match):
        auto_precision_reason(device)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"^AutocastState\.device\(device_type.*" + match):
        autocast_state().device(device)  # type: ignore[arg-type]


def test_device_objects_and_indices_are_accepted_where_a_device_type_is_wanted() -> None:
    assert resolve_precision("16-mixed", torch.device("cpu")) == torch.float16
    assert resolve_precision("bf16-mixed", "cpu:0") == torch.bfloat16
    assert auto_precision_reason(torch.device("cpu")) == auto_precision_reason("cpu")
    assert autocast_state().device(torch.device("cpu")).device_type == "cpu"


def test_cuda_precision_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, anywhere
    with pytest.raises(ValueError, match=r"is not allowed here: CUDA is not available\. Allowed: .*HINT: "):
        resolve_precision("16-mixed", "cuda")


def fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """Pretend a CUDA device of ``capability`` is present (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
    )


@pytest.mark.parametrize(
    ("capability", "dtype", "reason"),
    [
        ((9, 0), torch.bfloat16, "bf16: CUDA device with compute capability 9.0 >= 8.0"),
        ((8, 0), torch.bfloat16, "bf16: CUDA device with compute capability 8.0 >= 8.0"),
        ((7, 5), torch.float16, "fp16: CUDA device with compute capability 7.5 < 8.0 (no bf16)"),
    ],
)
def test_auto_on_cuda_follows_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], dtype: torch.dtype, reason: str
) -> None:
    fake_cuda(monkeypatch, capability)
    assert resolve_precision("auto", "cuda") == dtype
    assert auto_precision_reason("cuda") == reason


def test_bf16_on_cuda_without_bf16_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, (7, 0))
    assert resolve_precision("16-mixed", "cuda") == torch.float16
    with pytest.raises(ValueError, match=r"'bf16-mixed'.*no bf16 support\. Allowed: .*HINT: use '16-mixed'"):
        resolve_precision("bf16-mixed", "cuda")


def test_dtype_the_backend_does_not_support_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PrivateUse1 backend declares its autocast dtypes, as torch.autocast reads them.
    backend = torch._C._get_privateuse1_backend_name()
    with pytest.raises(ValueError, match=r"autocast has: \[\]\. HINT: use another device type"):
        resolve_precision("bf16-mixed", backend)
    module = types.SimpleNamespace(get_amp_supported_dtype=lambda: [torch.bfloat16])
    monkeypatch.setattr(torch, backend, module, raising=False)
    with pytest.raises(ValueError, match=r"needs torch\.float16 autocast.*HINT: use 'bf16-mixed'"):
        resolve_precision("16-mixed", backend)
    assert resolve_precision("auto", backend) == torch.bfloat16


@pytest.mark.parametrize("name", ["fp8", "transformer-engine"])
def test_an_fp8_precision_string_points_at_the_fp8_argument(name: str) -> None:
    with pytest.raises(ValueError, match=r"HINT: .*fp8='tensorwise'"):
        check_precision(name)
