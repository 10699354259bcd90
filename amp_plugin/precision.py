"""Precision strings: which autocast dtype a string means on a device type, and what ``"auto"`` picks.

``"16-mixed"`` is fp16 and ``"bf16-mixed"`` bf16 on every device type whose autocast runs
them (fp16 on CPU included, unlike Lightning); ``"auto"`` picks bf16 where the device has it.
``"16-true"`` and ``"bf16-true"`` name the same dtypes with the weights themselves held in
half precision; ``"32-true"`` is fp32 with autocast off (Apex's O0).
Plain torch: nothing here imports Lightning, and only the device type asked about is initialised.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch

from amp_plugin._validation import check_device_type, fail

__all__ = ["auto_precision_reason", "check_device", "native_on_cpu", "resolve_precision"]

Precision = Literal["16-mixed", "bf16-mixed", "auto", "16-true", "bf16-true", "32-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""Every precision string ``AMPPrecision`` accepts, in the order of the ``Precision`` type."""

_DTYPES = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "32-true": torch.float32,
}
# Common near misses (Lightning spellings, dtype names) and the string they meant.
_HINTS = {
    **dict.fromkeys(("16", "fp16", "float16", "half", "torch.float16"), "use '16-mixed' for fp16 autocast"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "use 'bf16-mixed' for bf16 autocast"),
    **dict.fromkeys(
        ("transformer-engine", "fp8", "float8", "8-mixed"),
        "for fp8 matmuls pass precision='bf16-mixed', fp8='tensorwise' (needs torchao: amp_plugin[fp8])",
    ),
    **dict.fromkeys(("32", "fp32", "float32"), "use '32-true' for fp32 (autocast off)"),
    **dict.fromkeys(("64", "64-true"), "for fp64 drop the AMP plugin and use Trainer(precision='64-true')"),
}
# Device types that compute natively in bf16; torch's default autocast dtype there is bf16 too.
_BF16_NATIVE = frozenset({"cpu", "hpu", "xla", "maia"})


def check_device(device: object, call: str) -> str:
    """The device type named by ``device`` (a ``str`` or ``torch.device``) if autocast has it.

    An index is dropped (``"cuda:0"`` and ``torch.device("cuda", 0)`` give ``"cuda"``). Whether
    such a device is present is not checked here. ``call`` names the entry point in the message.

    Raises:
        TypeError: ``device`` is neither a ``str`` nor a ``torch.device``.
        ValueError: it names no device type that has autocast (``"gpu"``, ``""``, ``"meta"``, ...).

    Example:
        >>> check_device("cuda:0", "AMPPrecision"), check_device(torch.device("cpu"), "AMPPrecision")
        ('cuda', 'cpu')
    """
    return check_device_type(call, "device", device)


def _supported_dtypes(device_type: str) -> list[torch.dtype]:
    # As torch.autocast decides: a PrivateUse1 backend declares its dtypes, every other type takes both.
    if device_type == torch._C._get_privateuse1_backend_name():
        getter = getattr(getattr(torch, device_type, None), "get_amp_supported_dtype", None)
        return list(getter()) if getter is not None else []
    return [torch.bfloat16, torch.float16]


def _auto_choice(device_type: str) -> tuple[torch.dtype, str]:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return torch.float16, "fp16: CUDA is not available, so its capability is unknown"
        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            return torch.bfloat16, f"bf16: CUDA device with compute capability {major}.{minor} >= 8.0"
        return torch.float16, f"fp16: CUDA device with compute capability {major}.{minor} < 8.0 (no bf16)"
    native = device_type in _BF16_NATIVE or (device_type == "xpu" and torch.xpu.is_bf16_supported())
    if native or torch.float16 not in _supported_dtypes(device_type):
        return torch.bfloat16, f"bf16: {device_type.upper()} autocast supports bf16"
    return torch.float16, f"fp16: no bf16 capability check for device type {device_type!r}"


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype`` math; fp32 and fp64 always count as native.

    bf16 counts where the CPU has AVX512-BF16 or AMX, fp16 where it has AVX512-FP16 or AMX-FP16
    (AMX tiles count too: every CPU with AMX also has AVX512-FP16). Without them CPU autocast
    emulates the dtype, and a model typically trains many times slower than in fp32
    (:func:`cpu_emulation_note` says so in words).

    Example:
        >>> native_on_cpu(torch.float32)
        True
    """
    probes = {
        torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
        torch.float16: ("_is_amx_fp16_supported", "_is_amx_tile_supported"),
    }
    if dtype not in probes:
        return True
    if dtype == torch.float16 and "avx512_fp16" in cpuinfo("flags").split():  # torch has no probe for it
        return True
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes[dtype])


@functools.cache
def cpuinfo(field: str) -> str:
    """The first ``field`` of Linux's ``/proc/cpuinfo`` (``"flags"``, ``"model name"``); ``""`` elsewhere.

    Read once per field and process: the CPU does not change while it runs.

    Example:
        >>> isinstance(cpuinfo("model name"), str)
        True
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as lines:
            for line in lines:
                if line.startswith(field):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


_INSTRUCTIONS = {
    torch.bfloat16: ("bf16", "AVX512-BF16 or AMX"),
    torch.float16: ("fp16", "AVX512-FP16 or AMX-FP16"),
}


def cpu_emulation_note(dtype: torch.dtype) -> str | None:
    """Say that this CPU emulates ``dtype`` under autocast, or ``None`` where it computes in it.

    The sentence names the instructions the CPU lacks (fp16 needs AVX512-FP16 or AMX-FP16, bf16
    AVX512-BF16 or AMX) and what it costs: training typically runs many times slower than in fp32.
    ``AMPPrecision`` says it once per process, as information when the precision was asked for
    by name and as a warning when ``"auto"`` chose it.

    Example:
        >>> cpu_emulation_note(torch.float32) is None
        True
    """
    if native_on_cpu(dtype) or dtype not in _INSTRUCTIONS:
        return None
    kind, needs = _INSTRUCTIONS[dtype]
    return (
        f"this CPU has no {kind} instructions ({needs}), so CPU autocast emulates {kind}, and "
        "training typically runs many times slower than in fp32"
    )


def auto_precision_reason(device_type: str | torch.device) -> str:
    """Say, in words, which dtype ``"auto"`` picks on ``device_type`` and why.

    Initialises only the device type asked about (CUDA only for ``"cuda"``).

    Example:
        >>> auto_precision_reason("cpu")
        'bf16: CPU autocast supports bf16'
    """
    return _auto_choice(check_device_type("auto_precision_reason", "device_type", device_type))[1]


def check_precision(precision: object, call: str = "check_precision") -> Precision:
    """Validate a precision string; raise ``ValueError`` with the allowed values and a hint.

    ``call`` names the entry point in the message (``"AMPPrecision"``, ``"resolve_precision"``).

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`; the hint names the string
            that a near miss (``"fp16"``, ``"bf16"``, ...) meant.

    Example:
        >>> check_precision("bf16-mixed")
        'bf16-mixed'
        >>> check_precision("fp16")
        Traceback (most recent call last):
        ...
        ValueError: check_precision(precision='fp16') is not allowed here: there is no such precision. ...
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        hint = _HINTS.get(str(precision).strip().lower(), "pick one of the allowed strings")
        allowed = "one of " + ", ".join(map(repr, PRECISIONS))
        fail(
            call,
            passed=f"precision={precision!r}",
            why="there is no such precision",
            allowed=allowed,
            hint=f"{hint}.",
        )
    return precision  # type: ignore[return-value]


def resolve_precision(
    precision: str, device_type: str | torch.device, *, call: str = "resolve_precision"
) -> torch.dtype:
    """Turn a precision string into the autocast dtype for ``device_type``.

    ``"16-mixed"`` is fp16 and ``"bf16-mixed"`` bf16, on every device type that supports
    them (fp16 on CPU included, unlike Lightning, which turns it into bf16). ``"auto"``
    picks bf16 where the device has it (CPU; CUDA compute capability >= 8.0), else fp16.
    ``device_type`` is checked by :func:`check_device` (``"cuda:0"`` counts as ``"cuda"``).
    ``call`` names the entry point in an error message (``"AMPPrecision"`` when the plugin asks);
    it then says ``device=`` for ``device_type=``, the plugin's argument.

    Raises:
        ValueError: unknown precision string, a device type without autocast, or a dtype
            the device's autocast cannot run.
        TypeError: ``device_type`` is neither a ``str`` nor a ``torch.device``.

    Example:
        >>> resolve_precision("16-mixed", "cpu")
        torch.float16
        >>> resolve_precision("auto", "cpu")
        torch.bfloat16
    """
    arg = "device_type" if call == "resolve_precision" else "device"
    check_precision(precision, call)
    device_type = check_device_type(call, arg, device_type)
    passed = f"precision={precision!r}, {arg}={device_type!r}"
    dtype = _auto_choice(device_type)[0] if precision == "auto" else _DTYPES[precision]
    if dtype == torch.float32:
        return dtype  # autocast stays off: nothing to check on the device
    if device_type == "cuda" and not torch.cuda.is_available():
        fail(
            call,
            passed=passed,
            why="CUDA is not available",
            allowed="a device type present on this machine, e.g. 'cpu'",
            hint=f"run on a machine with a CUDA GPU and a CUDA build of torch, or pass {arg}='cpu'.",
        )
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        fail(
            call,
            passed=passed,
            why="this CUDA device has no bf16 support",
            allowed="'16-mixed' or '16-true' here ('bf16-mixed' needs compute capability 8.0 or newer)",
            hint="use '16-mixed'.",
        )
    supported = _supported_dtypes(device_type)
    if dtype not in supported:
        other = "'bf16-mixed'" if torch.bfloat16 in supported else "another device type"
        fail(
            call,
            passed=passed,
            why=f"it needs {dtype} autocast, which {device_type!r} autocast does not have",
            allowed=f"a precision whose dtype {device_type!r} autocast has: {supported}",
            hint=f"use {other}.",
        )
    return dtype


def true_dtype(precision: str) -> torch.dtype | None:
    """The dtype in which a "-true" precision builds and holds the weights; ``None`` for the others.

    Example:
        >>> true_dtype("bf16-true"), true_dtype("bf16-mixed")
        (torch.bfloat16, None)
    """
    return _DTYPES[precision] if precision in ("16-true", "bf16-true") else None


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` torch's default floating-point dtype inside the block; restore it after.

    What Lightning's ``HalfPrecision`` does around module creation and forward passes, so that
    "-true" layers are born in half precision (never an fp32 copy first).

    Example:
        >>> with default_dtype(torch.bfloat16):
        ...     torch.ones(1).dtype
        torch.bfloat16
        >>> torch.get_default_dtype()
        torch.float32
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
