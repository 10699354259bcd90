"""One way to reject bad input: say what was passed, what is allowed, and ``HINT:`` the fix.

Every public entry point checks all of its arguments with these helpers *before* it changes
any state, so a rejected call leaves nothing half-applied. Invariants that a caller can
break raise here too, never through ``assert``.

Example:
    >>> check_bool("LossScaler", "enabled", "False")
    Traceback (most recent call last):
    ...
    TypeError: LossScaler(enabled='False') is not allowed here: it is a str, not a bool. Allowed: ...
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn

import torch

__all__ = [
    "autocast_device_types",
    "check_bool",
    "check_choice",
    "check_device_type",
    "check_int",
    "check_number",
    "check_tensor_scalar",
    "device_hint",
    "fail",
    "is_number",
]


def fail(
    call: str,
    *,
    passed: str,
    why: str | None = None,
    allowed: str,
    hint: str,
    error: type[Exception] = ValueError,
) -> NoReturn:
    """Raise ``error`` with the project's one message format.

    The message reads ``{call}({passed}) is not allowed here: {why}. Allowed: {allowed}. HINT:
    {hint}``: what was passed, why it cannot be, what can, and the fix. ``call`` is the public
    name the user called (``"AMPPrecision"``, ``"LossScaler.update"``), never an internal
    helper's; ``passed`` is the argument as passed (``"name=value"``). ``why`` may be left out
    only for a ``TypeError`` (it then says "wrong type"). Everything but ``call`` is a keyword, so
    a call site reads as the message does.

    Example:
        >>> fail("LossScaler", passed="min_scale=8.0, max_scale=1.0", why="min_scale is above max_scale",
        ...      allowed="min_scale <= max_scale", hint="swap the two bounds.")
        Traceback (most recent call last):
        ...
        ValueError: LossScaler(min_scale=8.0, max_scale=1.0) is not allowed here: min_scale is above ...
    """
    reason = why if why is not None else ("wrong type" if issubclass(error, TypeError) else "invalid")
    raise error(f"{call}({passed}) is not allowed here: {reason}. Allowed: {allowed}. HINT: {hint}")


def is_number(value: object) -> bool:
    """A finite real number: an ``int`` or ``float`` (bools and NaN/inf excluded).

    Example:
        >>> is_number(2.0), is_number(True), is_number(float("nan")), is_number("1")
        (True, False, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_bool(call: str, name: str, value: object) -> bool:
    """``value`` if it is a real ``bool``; a string such as ``"False"`` is refused (it is truthy).

    Example:
        >>> check_bool("AMPPrecision", "clip_fused", True)
        True
    """
    if not isinstance(value, bool):
        fail(
            call,
            passed=f"{name}={value!r}",
            why=f"it is a {type(value).__name__}, not a bool",
            allowed="a bool (True or False)",
            hint=(
                f"pass {name}=True or {name}=False, not the {type(value).__name__} {value!r} "
                "(any non-empty string is truthy)."
            ),
            error=TypeError,
        )
    return value


def check_number(
    call: str,
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """``float(value)`` for a finite number within the bounds, else a clear error.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``. A non-number raises
    ``TypeError``; NaN, inf or a number out of bounds raises ``ValueError``.

    Example:
        >>> check_number("clip_grad_norm_", "max_norm", 1, low=0.0)
        1.0
    """
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is not None and not (
        not math.isfinite(number)
        or (low is not None and (number <= low if low_open else number < low))
        or (high is not None and (number >= high if high_open else number > high))
    ):
        return number  # the message below is built only for a refusal: this check runs per step
    lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
    allowed = ("a finite number " + " and ".join(b for b in (lo, hi) if b)).strip()
    hint = hint or f"pass a plain Python float for {name}."
    got = f"{name}={value!r}"
    if number is None:
        why = f"it is a {type(value).__name__}, not a number"
        fail(call, passed=got, why=why, allowed=allowed, hint=hint, error=TypeError)
    why = "it is not finite" if not math.isfinite(number) else "it is out of range"
    fail(call, passed=got, why=why, allowed=allowed, hint=hint)


def check_int(call: str, name: str, value: object, *, low: int | None = None, hint: str = "") -> int:
    """``value`` for an ``int`` (not a bool) ``>= low``, else a clear error.

    Example:
        >>> check_int("LossScaler", "growth_interval", 2000, low=1)
        2000
    """
    allowed = "an int" + ("" if low is None else f" >= {low}")
    hint = hint or f"pass a plain Python int for {name}."
    got = f"{name}={value!r}"
    if not isinstance(value, int) or isinstance(value, bool):
        why = f"it is a {type(value).__name__}, not an int"
        fail(call, passed=got, why=why, allowed=allowed, hint=hint, error=TypeError)
    if low is not None and value < low:
        fail(call, passed=got, why=f"it is below {low}", allowed=allowed, hint=hint)
    return value


def check_choice(call: str, name: str, value: object, choices: Iterable[object], hint: str = "") -> Any:
    """``value`` if it is one of ``choices`` (compared by type and value: ``1`` is not ``True``).

    Example:
        >>> check_choice("AMPPrecision", "clip_fused", "auto", ("auto", True, False))
        'auto'
    """
    options = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in options):
        allowed = "one of " + ", ".join(map(repr, options))
        why = "it is none of the choices" if len(options) > 1 else "it is not the one choice"
        fail(
            call,
            passed=f"{name}={value!r}",
            why=why,
            allowed=allowed,
            hint=hint or f"pass {name}={options[0]!r}.",
        )
    return value


_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "maia", "xla", "ipu")
# Names that are not device types but are often passed as one, and what to say about them.
_DEVICE_HINTS = {
    "gpu": "'gpu' is Lightning's accelerator name; the device type is 'cuda'",
    "tpu": "'tpu' is Lightning's accelerator name; the device type is 'xla'",
    "auto": "'auto' is Lightning's accelerator choice, not a device type; pass e.g. 'cuda' or 'cpu'",
}


def autocast_device_types() -> tuple[str, ...]:
    """The device types that have autocast in this torch build; asking initialises no device.

    Example:
        >>> autocast_device_types()[:2]
        ('cpu', 'cuda')
    """
    candidates = (*_KNOWN_DEVICE_TYPES, torch._C._get_privateuse1_backend_name())
    return tuple(dict.fromkeys(d for d in candidates if torch.amp.is_autocast_available(d)))


def check_device_type(call: str, name: str, value: object) -> str:
    """The device type of ``value`` (a ``str`` or ``torch.device``; an index is dropped) if it has autocast.

    Example:
        >>> check_device_type("resolve_precision", "device_type", "cuda:0")
        'cuda'
    """
    got, types = f"{name}={value!r}", ", ".join(map(repr, autocast_device_types()))
    if not isinstance(value, (str, torch.device)):
        index = isinstance(value, int) and not isinstance(value, bool)
        hint = (
            f"{value!r} looks like a CUDA index: pass 'cuda'."
            if index
            else "pass a device type such as 'cuda'."
        )
        fail(
            call,
            passed=got,
            why=f"it is a {type(value).__name__}, not a device type",
            allowed=f"a str or torch.device whose type has autocast: {types}",
            hint=hint,
            error=TypeError,
        )
    try:
        device_type = torch.device(value).type
    except RuntimeError:  # torch's message lists every device type it knows, autocast or not
        device_type, why = "", "torch knows no such device type"
    else:
        available = torch.amp.is_autocast_available(device_type)
        why = "" if available else f"autocast is not available for device type {device_type!r}"
    if why:
        allowed = f"a device type with autocast: {types}"
        fail(call, passed=got, why=why, allowed=allowed, hint=device_hint(value))
    return device_type


def device_hint(value: object) -> str:
    text, types = str(value), autocast_device_types()
    if text.lower() in _DEVICE_HINTS:
        return _DEVICE_HINTS[text.lower()] + "."
    if text != text.lower() and text.lower() in types:
        return f"device types are lowercase: {text.lower()!r}."
    if ":" in text and text.partition(":")[0] in types:
        return f"write the device type alone, e.g. {text.partition(':')[0]!r} (or with an index, 'cuda:0')."
    return "pass a device type such as 'cuda' or 'cpu' (for a device object, `device.type`)."


def check_tensor_scalar(call: str, name: str, value: object, hint: str = "") -> torch.Tensor:
    """``value`` if it is a one-element floating-point tensor that does not require grad.

    Example:
        >>> check_tensor_scalar("update", "new_scale", torch.tensor(2.0))
        tensor(2.)
    """
    why = (
        "it is not a tensor"
        if not isinstance(value, torch.Tensor)
        else f"it has {value.numel()} elements"
        if value.numel() != 1
        else f"its dtype is {value.dtype}"
        if not value.is_floating_point()
        else "it requires grad"
        if value.requires_grad
        else None
    )
    if why is not None:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        got = f"{name}={type(value).__name__}" + ("" if shape is None else f" of shape {shape}")
        fail(
            call,
            passed=got,
            why=why,
            allowed="a one-element floating-point tensor without requires_grad",
            hint=hint or "pass a float.",
        )
    return value  # type: ignore[return-value]


def check_module(call: str, name: str, value: object, hint: str = "pass the model itself.") -> Any:
    """``value`` if it is a ``torch.nn.Module``; else raise ``TypeError`` (what was passed, ``HINT:``).

    Example:
        >>> check_module("audit", "model", 3)
        Traceback (most recent call last):
        ...
        TypeError: audit(model=int) is not allowed here: wrong type. Allowed: a torch.nn.Module. HINT: ...
    """
    if not isinstance(value, torch.nn.Module):
        passed = f"{name}={type(value).__name__}"
        fail(call, passed=passed, allowed="a torch.nn.Module", hint=hint, error=TypeError)
    return value
