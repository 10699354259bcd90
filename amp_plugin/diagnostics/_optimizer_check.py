"""Fit-start check of optimizers for mixed precision.

Turns what torch reports late and obscurely ("Attempting to unscale FP16 gradients", "No inf
checks were recorded for this optimizer") into findings that name the parameters. Plain torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from amp_plugin._optim import unwrap_optimizer
from amp_plugin._validation import check_bool, check_device_type, check_module, fail
from amp_plugin.diagnostics._audit import Finding, join_names

__all__ = ["check_optimizer_setup"]

_CALL = "check_optimizer_setup"


def check_optimizer_setup(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[Any],
    *,
    device_type: str | torch.device,
    dtype: torch.dtype,
    master_weights: bool = False,
    grad_scaling: bool | None = None,
) -> list[Finding]:
    """Find, at fit start, what would otherwise fail or mislead later in mixed-precision training.

    Errors: float16 parameters held by an optimizer while fp16 loss scaling is on and there are
    no master weights (torch would fail later with "Attempting to unscale FP16 gradients"); an
    optimizer none of whose parameters requires grad. Warnings: other float16/bfloat16
    parameters without master weights; parameters on a device type that autocast for
    ``device_type`` does not cover; parameters that are not in ``model``.

    Args:
        model: the model being trained.
        optimizers: an optimizer or several (wrappers such as ``LightningOptimizer`` are unwrapped).
        device_type: the autocast device type, e.g. ``"cuda"`` (a ``torch.device`` or ``"cuda:0"``
            counts as its type; see :func:`~amp_plugin.precision.check_device`).
        dtype: the autocast dtype, ``torch.float16`` or ``torch.bfloat16``.
        master_weights: whether fp32 master copies of half-precision parameters are kept.
        grad_scaling: whether the loss is scaled; ``None`` means "when ``dtype`` is float16".

    Raises:
        TypeError / ValueError: arguments of the wrong type or value (checked before any finding).

    Example:
        >>> model = nn.Linear(4, 4).half()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> [f.code for f in check_optimizer_setup(model, opt, device_type="cpu", dtype=torch.float16)]
        ['fp16-params']
    """
    device_type = _check_setup_args(model, device_type, dtype, master_weights, grad_scaling)
    scaling = dtype == torch.float16 if grad_scaling is None else grad_scaling
    names = {id(p): n for n, p in model.named_parameters()}
    found: list[Finding] = []
    for i, opt in enumerate(_as_list(optimizers)):
        inner = unwrap_optimizer(opt)
        params: list[Tensor] = [p for group in inner.param_groups for p in group["params"]]
        ctx = _OptContext(f"optimizer {i} ({type(inner).__name__})", params, names)
        found += _precision_findings(ctx, scaling, master_weights)
        found += _placement_findings(ctx, device_type)
    return found


@dataclass(frozen=True)
class _OptContext:
    label: str
    params: list[Tensor]
    names: dict[int, str]

    def name(self, p: Tensor) -> str:
        return self.names.get(id(p), f"<not in model, shape {list(p.shape)}>")


def _as_list(optimizers: Any) -> list[Any]:
    # A lone optimizer (or wrapper) has param_groups; a list, tuple or generator of them does not.
    if hasattr(optimizers, "param_groups") or not isinstance(optimizers, Iterable):
        return [optimizers]
    return list(optimizers)


def _check_setup_args(model: Any, device: Any, dtype: Any, master_weights: Any, grad_scaling: Any) -> str:
    check_module(_CALL, "model", model, hint="pass the model whose parameters the optimizers hold.")
    device_type = check_device_type(_CALL, "device_type", device)
    if dtype not in (torch.float16, torch.bfloat16):
        error = ValueError if isinstance(dtype, torch.dtype) else TypeError
        hint = "pass the torch.dtype, e.g. torch.float16, of the autocast precision in use."
        fail(
            _CALL,
            passed=f"dtype={dtype!r}",
            why="only a half-precision dtype needs this check",
            allowed="torch.float16 or torch.bfloat16",
            hint=hint,
            error=error,
        )
    check_bool(_CALL, "master_weights", master_weights)
    if grad_scaling is not None and not isinstance(grad_scaling, bool):
        fail(
            _CALL,
            passed=f"grad_scaling={grad_scaling!r}",
            allowed="None or a bool",
            hint="leave it None (scaling with float16) or pass True or False.",
            error=TypeError,
        )
    return device_type


def _precision_findings(ctx: _OptContext, scaling: bool, master_weights: bool) -> Iterator[Finding]:
    if not any(p.requires_grad for p in ctx.params):
        yield Finding(
            "error",
            "no-trainable-params",
            f"{ctx.label} holds {len(ctx.params)} parameter(s), none of which requires grad, so it never "
            'gets a gradient (with loss scaling torch fails with "No inf checks were recorded for this '
            'optimizer"). HINT: unfreeze its parameters, or do not return this optimizer.',
        )
    if master_weights:
        return
    fp16 = [ctx.name(p) for p in ctx.params if p.dtype == torch.float16 and p.requires_grad]
    if scaling and fp16:
        yield Finding(
            "error",
            "fp16-params",
            f"{ctx.label} holds {len(fp16)} float16 parameter(s) ({join_names(fp16)}) while fp16 loss "
            "scaling is on and there are no fp32 master weights. Their gradients are float16 too: times the "
            "loss scale they overflow at 65504 far sooner than fp32 ones, and the optimizer updates float16 "
            "weights directly, so updates below a weight's float16 spacing are lost (torch's GradScaler "
            'refuses them: "Attempting to unscale FP16 gradients"). '
            "HINT: keep the parameters in float32 under autocast (remove `.half()` from the model), or use "
            "precision='bf16-mixed'.",
            tuple(fp16),
        )
    low = [
        ctx.name(p)
        for p in ctx.params
        if p.dtype == torch.bfloat16 or (p.dtype == torch.float16 and not scaling)
    ]
    if low:
        yield Finding(
            "warning",
            "half-params",
            f"{ctx.label} updates {len(low)} half-precision parameter(s) ({join_names(low)}) without master "
            "weights: updates smaller than 1/256 (bf16) or 1/2048 (fp16) of a weight round away. "
            "HINT: keep float32 parameters and let autocast cast them per op.",
            tuple(low),
        )


def _placement_findings(ctx: _OptContext, device_type: str) -> Iterator[Finding]:
    elsewhere = [p for p in ctx.params if p.device.type not in (device_type, "meta")]
    if elsewhere:
        types = sorted({p.device.type for p in elsewhere})
        yield Finding(
            "warning",
            "device-not-autocast",
            f"{ctx.label} holds {len(elsewhere)} parameter(s) on {'/'.join(types)} "
            f"({join_names([ctx.name(p) for p in elsewhere])}), but autocast runs for {device_type!r} only: "
            f"ops on them get no mixed precision. HINT: move the model to the {device_type!r} device, or set "
            "AMPPrecision(device=...) to the device it runs on.",
            tuple(ctx.name(p) for p in elsewhere),
        )
    foreign = [p for p in ctx.params if id(p) not in ctx.names]
    if foreign:
        yield Finding(
            "warning",
            "params-not-in-model",
            f"{ctx.label} holds {len(foreign)} parameter(s) that are not in the model "
            f"({join_names([ctx.name(p) for p in foreign])}): the model's loss gives them no gradient. "
            "HINT: build the optimizer from self.parameters() (or the submodules it should train).",
        )
