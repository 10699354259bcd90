"""Apex's opt levels O0-O3 as ``AMPPrecision`` arguments (``AMPPrecision.from_opt_level``).

=====  ==================  =============  ===================  ==============  ===========
level  Apex                precision      keep_batchnorm_fp32  master_weights  loss_scale
=====  ==================  =============  ===================  ==============  ===========
O0     fp32                ``"32-true"``  (n/a)                False           (none)
O1     patched functions   ``"16-mixed"`` (n/a, weights fp32)  False           dynamic
O2     fp16 model          ``"16-mixed"`` True                 True            dynamic
O3     pure fp16           ``"16-true"``  False                False           1.0, static
=====  ==================  =============  ===================  ==============  ===========

O1's per-function casting is autocast here. Apex's ``amp.initialize`` keyword arguments
override a level's defaults under the same names (``cast_model_type``, ``keep_batchnorm_fp32``,
``master_weights``, ``loss_scale``, ``min_loss_scale``, ``max_loss_scale``); any other keyword
goes to ``AMPPrecision`` as it is. ``cast_model_type=torch.bfloat16`` gives the bf16 rungs, and
``master_weights="remainder"`` with it O2 with remainder masters (bf16 only).
Plain Python (nothing here imports Lightning); it sits beside the adapters whose arguments it builds.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_plugin._scaler import LossScaler
from amp_plugin._validation import check_bool, fail, is_number
from amp_plugin.master_weights import NORM_LAYERS, check_master_weights

__all__ = ["APEX_OPTIONS", "OPT_LEVELS", "opt_level_arguments"]

OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3")
#: The ``apex.amp.initialize`` keywords :func:`opt_level_arguments` understands.
APEX_OPTIONS: tuple[str, ...] = (
    "cast_model_type",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
    "min_loss_scale",
    "max_loss_scale",
)
# Apex's table: (model cast dtype or None, keep_batchnorm_fp32, master_weights, loss_scale)
_TABLE: dict[str, tuple[torch.dtype | None, bool | None, bool, float | str | None]] = {
    "O0": (torch.float32, None, False, None),
    "O1": (None, None, False, "dynamic"),
    "O2": (torch.float16, True, True, "dynamic"),
    "O3": (torch.float16, False, False, 1.0),
}
_CALL = "AMPPrecision.from_opt_level"


def opt_level_arguments(level: object, **overrides: Any) -> dict[str, Any]:
    """The ``AMPPrecision`` keyword arguments for Apex opt level ``level`` with ``overrides``.

    Raises:
        ValueError: an unknown level, or an override that contradicts the level (master
            weights without a cast model, a loss scale for bf16 or fp32, ...).
        TypeError: an override of the wrong type.

    Example:
        >>> args = opt_level_arguments("O2")
        >>> args["precision"], args["master_weights"], type(args["scaler"]).__name__
        ('16-mixed', True, 'LossScaler')
        >>> opt_level_arguments("O3")["scaler"].get_scale(), opt_level_arguments("O0")
        (1.0, {'precision': '32-true'})
        >>> opt_level_arguments("O4")
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision.from_opt_level(level='O4') is not allowed here: Apex has no ....
    """
    if level not in OPT_LEVELS:
        hint = (
            f"use {level.upper()!r}" if isinstance(level, str) and level.upper() in OPT_LEVELS else "use 'O1'"
        )
        fail(
            _CALL,
            passed=f"level={level!r}",
            why="Apex has no such opt level",
            allowed="one of " + ", ".join(map(repr, OPT_LEVELS)),
            hint=f"{hint} (the letter O, not zero).",
        )
    cast, keep_bn, level_masters, loss_scale = _TABLE[str(level)]
    apex = {k: overrides.pop(k) for k in APEX_OPTIONS if k in overrides}
    cast = apex.get("cast_model_type", cast)
    if cast not in (None, torch.float16, torch.bfloat16, torch.float32):
        fail(
            _CALL,
            passed=f"cast_model_type={cast!r}",
            allowed="None, torch.float16, torch.bfloat16 or torch.float32",
            hint="pass a torch dtype, e.g. torch.float16.",
            error=TypeError,
        )
    half = torch.bfloat16 if cast == torch.bfloat16 else torch.float16
    masters = check_master_weights(_CALL, apex.get("master_weights", level_masters), half)
    keep = apex.get("keep_batchnorm_fp32", keep_bn)
    if keep is not None:
        check_bool(_CALL, "keep_batchnorm_fp32", keep)
    prefix = "bf16" if half == torch.bfloat16 else "16"
    args: dict[str, Any]
    if cast == torch.float32:
        args = {"precision": "32-true"}
    elif cast is None or masters:
        args = {"precision": f"{prefix}-mixed", "master_weights": masters}
    else:
        args = {"precision": f"{prefix}-true"}
    if masters and cast in (None, torch.float32):
        given = [f"{name}={apex[name]!r}" for name in ("cast_model_type", "master_weights") if name in apex]
        fail(
            _CALL,
            passed=", ".join([f"level={level!r}", *given]),
            why="only a model cast to half has weights to master"
            + ("" if "master_weights" in apex else f" (level {level} keeps master weights)"),
            allowed=(
                "master weights with a model cast to half (O2, or cast_model_type=torch.float16/bfloat16)"
            ),
            hint=(
                "use level 'O2' (an fp16 model with fp32 masters), or master_weights=False for an fp32 model."
            ),
        )
    if keep is not None and cast not in (None, torch.float32):
        args["keep_fp32"] = NORM_LAYERS if keep else ()
    args.update(_scaler_arguments(args["precision"], apex, loss_scale))
    if not args.get("master_weights", True):
        del args["master_weights"]
    clash = sorted(set(args) & set(overrides))
    if clash:
        fail(
            _CALL,
            passed=f"{clash[0]}=...",
            why=f"the opt level sets {clash[0]}",
            allowed=f"no {clash[0]!r} next to an opt level (the level sets it)",
            hint=f"use Apex's keywords ({', '.join(APEX_OPTIONS)}) or AMPPrecision(...) directly.",
        )
    return {**args, **overrides}


def _scaler_arguments(precision: str, apex: dict[str, Any], default: float | str | None) -> dict[str, Any]:
    loss_scale: Any = apex.get("loss_scale", default)
    bounds = {k: apex[k] for k in ("min_loss_scale", "max_loss_scale") if k in apex}
    fp16 = precision in ("16-mixed", "16-true")
    if not fp16:
        if "loss_scale" in apex or bounds:
            fail(
                _CALL,
                passed=f"loss_scale={apex.get('loss_scale')!r}",
                why="bf16 and fp32 need no loss scaling",
                allowed="no loss scaling with bf16 or fp32",
                hint="drop loss_scale, min_loss_scale and max_loss_scale.",
            )
        return {}
    if loss_scale != "dynamic" and not (is_number(loss_scale) and loss_scale > 0):
        fail(
            _CALL,
            passed=f"loss_scale={loss_scale!r}",
            why="a loss scale must be a positive number",
            allowed="'dynamic' or a finite number > 0",
            hint="use loss_scale='dynamic'.",
        )
    if loss_scale == "dynamic":
        low, high = bounds.get("min_loss_scale"), bounds.get("max_loss_scale", 2.0**24)
        if is_number(low) and is_number(high) and low > high:
            fail(
                _CALL,
                passed=", ".join(f"{name}={value!r}" for name, value in bounds.items()),
                why="min_loss_scale is above max_loss_scale"
                + ("" if "max_loss_scale" in bounds else " (2**24 by default, as in Apex)"),
                allowed="min_loss_scale <= max_loss_scale",
                hint="lower min_loss_scale, or raise max_loss_scale.",
            )
        start = 2.0**16  # Apex's first dynamic scale, moved into the bounds
        if isinstance(low, (int, float)) and is_number(low):
            start = max(start, float(low))
        if isinstance(high, (int, float)) and is_number(high):
            start = min(start, float(high))
        scaler = LossScaler(init_scale=start, min_scale=low, max_scale=high)
    else:
        if bounds:
            fail(
                _CALL,
                passed="min_loss_scale/max_loss_scale with a static loss_scale",
                why="a static loss scale never moves, so it has no bounds",
                allowed=("bounds only with loss_scale='dynamic'"),
                hint="drop the bounds, or use loss_scale='dynamic'.",
            )
        scaler = LossScaler(init_scale=float(loss_scale), dynamic=False)
    return {"scaler": scaler}
