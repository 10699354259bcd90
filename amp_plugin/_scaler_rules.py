"""What a valid ``LossScaler`` configuration, state dict and manual scale are.

Every check runs before the scaler changes anything, so a rejected call leaves it as it
was. Messages follow :mod:`amp_plugin._validation`: what was passed, what is allowed, a hint.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from amp_plugin import _imports
from amp_plugin._validation import check_device_type, check_number, check_tensor_scalar, fail, is_number
from amp_plugin.kernels import Backend, check_backend

__all__ = [
    "SCALE_FLOOR",
    "check_config",
    "check_device",
    "check_kernels",
    "check_manual_scale",
    "check_norm_type",
    "checked_state",
]

# The smallest normal positive fp32 (2**-126): the scale never goes below it. GradScaler's own
# scale can shrink past it into subnormals and then to exactly 0, where 0 * (1 / 0) = NaN
# gradients pass the inf check (it looks at the scaled values) and reach the weights.
SCALE_FLOOR = torch.finfo(torch.float32).tiny
# The scale is an fp32 tensor: a Python float above fp32's largest finite value would become inf.
SCALE_CEILING = torch.finfo(torch.float32).max

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OWN_KEYS = (
    "hysteresis",
    "_hysteresis_tracker",
    "min_scale",
    "max_scale",
    "dynamic",
    "skipped_steps",
    "total_steps",
)
_CALL = "LossScaler"


def check_config(
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    call: str = _CALL,
    scale_name: str = "init_scale",
) -> None:
    """Check the scaler's numeric settings together (the bounds and the start scale interact).

    ``scale_name`` is what the start scale is called where it came from (a state dict's key).
    """

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    low = min_scale if is_number(min_scale) else SCALE_FLOOR
    high = max_scale if is_number(max_scale) else SCALE_CEILING
    fp32 = f"[{SCALE_FLOOR:g}, {SCALE_CEILING:g}] (fp32's normal range: the scale is an fp32 tensor)"
    if not (isinstance(init_scale, (int, float)) and not isinstance(init_scale, bool)):
        fail(
            call,
            passed=f"{scale_name}={init_scale!r:.80}",
            allowed="a number (an int or a float)",
            hint="2.0**16 is usual for fp16.",
            error=TypeError,
        )
    rules = [
        (
            is_number(init_scale) and SCALE_FLOOR <= init_scale <= SCALE_CEILING,
            f"{scale_name}={init_scale!r}",
            "a scale outside fp32's normal range (or not finite) cannot scale anything",
            f"a finite number in {fp32}",
            "2.0**16 is usual for fp16.",
        ),
        (
            is_number(growth_factor) and growth_factor > 1,
            f"growth_factor={growth_factor!r}",
            "a growth factor must make the scale grow",
            "a finite number > 1",
            "2.0 doubles the scale after growth_interval clean steps.",
        ),
        (
            is_number(backoff_factor) and 0 < backoff_factor < 1,
            f"backoff_factor={backoff_factor!r}",
            "a backoff factor must make the scale shrink",
            "a number in (0, 1)",
            "0.5 halves the scale on overflow.",
        ),
        (
            count(growth_interval),
            f"growth_interval={growth_interval!r}",
            "it counts clean steps",
            "an int >= 1",
            "2000 is torch's default.",
        ),
        (
            count(hysteresis),
            f"hysteresis={hysteresis!r}",
            "it counts overflows",
            "an int >= 1",
            "1 backs off on every overflow (torch's behaviour); 2 tolerates one overflow in a row.",
        ),
        (
            min_scale is None or (is_number(min_scale) and SCALE_FLOOR <= min_scale <= SCALE_CEILING),
            f"min_scale={min_scale!r}",
            "a floor outside fp32's normal range (or not finite) cannot hold the scale",
            f"None or a finite number in {fp32}",
            "e.g. min_scale=1.0 keeps the scale off 0.",
        ),
        (
            max_scale is None or (is_number(max_scale) and 0 < max_scale <= SCALE_CEILING),
            f"max_scale={max_scale!r}",
            "a ceiling must be a positive scale that fp32 holds",
            f"None or a finite number in (0, {SCALE_CEILING:g}]",
            "e.g. max_scale=2.0**24.",
        ),
        (
            low <= high,
            f"min_scale={min_scale!r}, max_scale={max_scale!r}",
            "min_scale is above max_scale",
            "min_scale <= max_scale",
            "swap the two bounds.",
        ),
        (
            not is_number(init_scale) or low <= init_scale <= high,
            f"{scale_name}={init_scale!r}",
            "the first scale must lie within min_scale and max_scale",
            f"a scale within [{low:g}, {high:g}]",
            "pick init_scale between min_scale and max_scale.",
        ),
    ]
    for ok, got, why, allowed, hint in rules:
        if not ok:
            fail(call, passed=got, why=why, allowed=allowed, hint=hint)


def check_norm_type(call: str, norm_type: object) -> float:
    """A norm order ``> 0`` (``inf`` and the string ``"inf"`` included), as a float."""
    value = float("inf") if norm_type in ("inf", "Inf") else norm_type
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        fail(
            call,
            passed=f"norm_type={norm_type!r}",
            why="a norm's order is a positive number or inf",
            allowed="a number > 0 or inf",
            hint="2.0 is the Euclidean norm.",
        )
    return float(value)


def check_manual_scale(
    new_scale: object, device: torch.device, min_scale: float | None, max_scale: float | None
) -> float | Tensor:
    """Validate ``update(new_scale=...)``: a finite scale within the scaler's bounds.

    A tensor is read once on the host to check its value (a manual scale is rare).
    """
    call, hint = "LossScaler.update", "pass the new scale as a float, e.g. update(new_scale=2.0**10)."
    if isinstance(new_scale, Tensor):
        check_tensor_scalar(call, "new_scale", new_scale, hint)
        if new_scale.device.type != device.type:
            fail(
                call,
                passed=f"new_scale on {new_scale.device}",
                why=f"the scaler's state lives on {device.type}",
                allowed=f"a tensor on {device.type}",
                hint=hint,
            )
        value = float(new_scale.item())
    else:
        value = check_number(call, "new_scale", new_scale, low=0.0, low_open=True, hint=hint)
    low = SCALE_FLOOR if min_scale is None else min_scale
    high = SCALE_CEILING if max_scale is None else max_scale
    if not (math.isfinite(value) and low <= value <= high):
        fail(
            call,
            passed=f"new_scale={value!r}",
            why="the scale must stay finite and within the scaler's bounds",
            allowed=f"a finite scale within [{low:g}, {high:g}]",
            hint=hint,
        )
    return new_scale if isinstance(new_scale, Tensor) else value


def checked_state(state_dict: Any, hysteresis: int, min_scale: Any, max_scale: Any) -> dict[str, Any]:
    """The state dict, with every key checked; raises ``ValueError`` naming the first bad entry."""
    what = "LossScaler.load_state_dict"
    if not isinstance(state_dict, dict) or not state_dict:
        fail(
            what,
            passed=f"state_dict={type(state_dict).__qualname__} {state_dict!r:.80}",
            why="it holds no loss-scaler state",
            allowed="the non-empty dict from LossScaler.state_dict() or torch.amp.GradScaler.state_dict()",
            hint=(
                "an empty dict comes from a disabled scaler (e.g. a bf16 run); do not load it into an "
                "fp16 scaler."
            ),
        )
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    unknown = sorted(map(str, set(state_dict) - set(TORCH_KEYS) - set(OWN_KEYS)))
    if missing or unknown:
        fail(
            what,
            passed=f"state_dict=<not a loss-scaler state: missing keys {missing}, unknown keys {unknown}>",
            why="it is not a loss scaler's state",
            allowed=f"the keys {list(TORCH_KEYS)} and optionally {list(OWN_KEYS)}",
            hint=(
                "pass the dict saved by LossScaler.state_dict() or torch.amp.GradScaler.state_dict(), "
                "not another object's state."
            ),
        )
    sd = {"hysteresis": hysteresis, "min_scale": min_scale, "max_scale": max_scale, **state_dict}
    check_config(
        sd["scale"],
        sd["growth_factor"],
        sd["backoff_factor"],
        sd["growth_interval"],
        sd["hysteresis"],
        sd["min_scale"],
        sd["max_scale"],
        call=what,
        scale_name="state_dict['scale']",
    )
    counts = {key: sd.get(key, 0) for key in ("_growth_tracker", "skipped_steps", "total_steps")}
    counts["_hysteresis_tracker"] = sd.get("_hysteresis_tracker", sd["hysteresis"])
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool):
            _corrupt(what, f"{key}={value!r}", "an int")
    limits = {
        "total_steps": (0, 2**62),
        "skipped_steps": (0, counts["total_steps"] if "total_steps" in sd else 2**62),
        # It resets to 0 when it reaches the interval; set_growth_interval() may move the interval
        # below it, and then it counts on (as torch's does) until an overflow resets it.
        "_growth_tracker": (0, 2**31 - 1),
        "_hysteresis_tracker": (-(2**31), sd["hysteresis"]),  # counts down from hysteresis on overflow
    }
    for key, (low, high) in limits.items():
        if not low <= counts[key] <= high:
            _corrupt(what, f"{key}={counts[key]!r}", f"an int in [{low}, {high}]")
    if not isinstance(sd.get("dynamic", True), bool):
        _corrupt(what, f"dynamic={sd['dynamic']!r}", "a bool")
    return sd


def _corrupt(what: str, got: str, allowed: str) -> None:
    fail(
        what,
        passed=got,
        why="no LossScaler saves such a value",
        allowed=allowed,
        hint="the state is corrupt; resume from another checkpoint or drop the scaler state.",
    )


def check_device(device: object) -> str | None:
    """``None`` (follow the first scaled loss) or the device type that ``device`` names."""
    return None if device is None else check_device_type(_CALL, "device", device)


def check_kernels(kernels: object) -> Backend:
    name = check_backend(kernels, _CALL, "kernels")
    if name == "apex" and not _imports.apex_available():
        fail(
            "LossScaler",
            passed="kernels='apex'",
            why=f"NVIDIA Apex amp_C does not import here ({_imports.apex_error()})",
            allowed="'auto' or 'torch' (or 'apex' where amp_C imports)",
            hint=f"pass kernels='auto', or: {_imports.APEX_HINT}",
            error=RuntimeError,
        )
    return name
