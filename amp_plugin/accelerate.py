"""Hugging Face Accelerate's fp16 training with a :class:`~amp_plugin.LossScaler` (optional extra).

``Accelerator(mixed_precision="fp16")`` scales the loss with a ``torch.amp.GradScaler`` that it
keeps in ``accelerator.scaler`` and hands to every optimizer it prepares. Accelerate calls only
the GradScaler methods a ``LossScaler`` has with the same meaning: ``scale`` (in
``accelerator.backward``), ``unscale_`` (in ``unscale_gradients`` and ``clip_grad_norm_``),
``step`` and ``update`` (in the prepared optimizer's ``step``, which calls them once per
synchronised step and reads a skipped step as ``optimizer_step_was_skipped``), and
``state_dict``/``load_state_dict`` (in ``save_state``/``load_state``). So the swap is one
attribute, made before ``prepare``. Accelerate is imported on use, never by ``import amp_plugin``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from amp_plugin._scaler import LossScaler
from amp_plugin._validation import fail

__all__ = ["use_loss_scaler"]

_CALL = "use_loss_scaler"
# Single process or DDP: the scaler is per process and LossScaler all-reduces its inf flag itself.
# DeepSpeed and Megatron-LM scale the loss themselves; FSDP and XLA need their own sharded scalers.
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")


def use_loss_scaler(accelerator: Any, scaler: LossScaler | None = None) -> LossScaler:
    """Make ``accelerator`` scale the loss with ``scaler`` instead of its ``GradScaler``; return it.

    Call it right after ``Accelerator(mixed_precision="fp16", ...)``, before ``prepare``. With
    ``scaler=None`` the ``LossScaler`` takes the settings and state of the ``GradScaler`` Accelerate
    made (``GradScalerKwargs`` included); on the CPU, where Accelerate makes none, it takes the
    ``GradScalerKwargs`` itself (else GradScaler's defaults), and turns on Accelerate's fp16
    autocast (``accelerator.native_amp``), which Accelerate itself leaves off on the CPU. A second
    call without ``scaler`` returns the installed one. Everything is checked before anything changes.

    Raises:
        ImportError: Accelerate is not installed.
        TypeError: ``accelerator`` is not an ``accelerate.Accelerator``, or ``scaler`` not a ``LossScaler``.
        ValueError: mixed precision other than fp16, a distributed type other than none/DDP, or a
            disabled ``scaler``.
        RuntimeError: a model or optimizer was prepared already (it holds the old scaler).

    Example:
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        >>> scaler = use_loss_scaler(accelerator, LossScaler(init_scale=1024.0, hysteresis=2))
        >>> accelerator.scaler is scaler, scaler.get_scale()
        (True, 1024.0)
    """
    current = _check(accelerator, scaler)
    if scaler is None:
        if isinstance(current, LossScaler):
            return current
        if current is None:  # on the CPU Accelerate builds no GradScaler, but keeps its kwargs
            handler = getattr(accelerator, "scaler_handler", None)
            scaler = LossScaler(**(handler.to_kwargs() if handler is not None else {}))
        else:
            scaler = LossScaler.from_grad_scaler(current)
    if accelerator.device.type == "cpu":
        accelerator.native_amp = True  # Accelerate's autocast (prepare, accelerator.autocast) and unscale_
    accelerator.scaler = scaler
    return scaler


def _check(accelerator: Any, scaler: LossScaler | None) -> Any:
    """Validate everything; return the accelerator's current scaler."""
    accelerate = _import_accelerate()
    if not isinstance(accelerator, accelerate.Accelerator):
        fail(
            _CALL,
            passed=f"accelerator={type(accelerator).__qualname__}",
            allowed="an accelerate.Accelerator",
            hint="pass the Accelerator your training loop uses.",
            error=TypeError,
        )
    precision = str(accelerator.mixed_precision)
    if precision != "fp16":
        hint = (
            "bf16 needs no loss scaler (it has fp32's range); drop this call."
            if precision == "bf16"
            else 'create it as Accelerator(mixed_precision="fp16").'
        )
        fail(
            _CALL,
            passed=f"an Accelerator with mixed_precision={precision!r}",
            why="only fp16 gradients need a loss scaler",
            allowed="fp16 mixed precision",
            hint=hint,
        )
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind not in _SUPPORTED:
        fail(
            _CALL,
            passed=f"an Accelerator with distributed_type={kind}",
            why=f"{kind} scales or shards the loss itself",
            allowed=("one process or DDP (NO, MULTI_CPU, MULTI_GPU)"),
            hint=(
                "keep Accelerate's own scaler there (DeepSpeed/Megatron-LM scale the loss "
                "themselves; FSDP and XLA shard it)."
            ),
        )
    if scaler is not None and not isinstance(scaler, LossScaler):
        fail(
            _CALL,
            passed=f"scaler={type(scaler).__qualname__}",
            allowed="a LossScaler or None",
            hint="pass amp_plugin.LossScaler(...), or None to convert Accelerate's GradScaler.",
            error=TypeError,
        )
    if scaler is not None and not scaler.is_enabled():
        fail(
            _CALL,
            passed="a disabled LossScaler",
            why="a disabled scaler neither scales nor checks fp16 gradients",
            allowed="an enabled one (fp16 gradients need scaling)",
            hint="build it with enabled=True (and device=None or the accelerator's device type).",
        )
    # Accelerate keeps what prepare() wrapped in these lists; a prepared optimizer holds the old scaler.
    if getattr(accelerator, "_optimizers", None) or getattr(accelerator, "_models", None):
        fail(
            _CALL,
            passed="an Accelerator after Accelerator.prepare",
            why="prepare() has wired the old scaler into the prepared optimizers",
            allowed=("one whose models and optimizers are not prepared yet"),
            hint=("call use_loss_scaler(accelerator) right after Accelerator(...), before prepare()."),
            error=RuntimeError,
        )
    current = accelerator.scaler
    if current is not None and not isinstance(current, (LossScaler, torch.amp.GradScaler)):
        fail(
            _CALL,
            passed=f"an Accelerator whose scaler is {type(current).__qualname__}",
            allowed="one with a torch.amp.GradScaler, a LossScaler or none",
            hint="keep Accelerate's own scaler.",
            error=TypeError,
        )
    return current


def _import_accelerate() -> Any:
    try:
        return importlib.import_module("accelerate")
    except ImportError as err:
        raise ImportError(
            "amp_plugin.accelerate needs Hugging Face Accelerate, which is not installed. "
            "HINT: pip install 'amp_plugin[accelerate]'."
        ) from err
