"""What ``AMPPrecision`` checks: its arguments, and at fit start what the Trainer hands over.

The fit-start side also reads the model it is handed: its device, the LightningModule inside a
strategy's wrapper, and whether any hook can look at the gradients between backward and step
(which decides the fast clipping path under ``clip_fused="auto"``).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import LBFGS, Optimizer

from amp_plugin import autocast, diagnostics
from amp_plugin._validation import check_choice, fail
from amp_plugin.optim import unwrap_optimizer
from amp_plugin.precision import check_precision
from amp_plugin.scaler import LossScaler

__all__ = [
    "check_arguments",
    "check_fit_start",
    "hooks_observe_gradients",
    "lightning_module",
    "module_device",
]

_OBSERVING_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")


def check_arguments(precision: object, scaler: object, clip_fused: object, lr_on_skip: object) -> None:
    """Raise ``ValueError`` / ``TypeError`` (what, allowed, ``HINT:``) for ``AMPPrecision`` arguments.

    Example:
        >>> check_arguments("16-mixed", LossScaler("cpu"), "auto", "hold")
        >>> check_arguments("bf16-mixed", LossScaler("cpu"), "auto", "hold")
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='bf16-mixed') does not use a loss scaler, ... HINT: drop scaler=...
    """
    check_precision(precision)
    if scaler is not None and not isinstance(scaler, (LossScaler, torch.amp.GradScaler)):
        fail(
            "AMPPrecision", f"scaler={scaler!r:.60}", "an amp_plugin.LossScaler or a torch.amp.GradScaler",
            "pass LossScaler(...) (it takes GradScaler's arguments), or leave scaler=None.", TypeError,
        )  # fmt: skip
    if scaler is not None and precision == "bf16-mixed":
        raise ValueError(
            "AMPPrecision(precision='bf16-mixed') does not use a loss scaler, but scaler= was passed. "
            "HINT: drop scaler=, or use precision='16-mixed'."
        )
    if scaler is not None and precision == "auto":
        raise ValueError(
            "AMPPrecision(precision='auto', scaler=...) is ambiguous: 'auto' picks bf16 (no scaler) where it "
            "can. HINT: pass precision='16-mixed' together with the scaler."
        )
    check_choice(
        "AMPPrecision", "clip_fused", clip_fused, ("auto", True, False), "use 'auto' (or a real bool)."
    )
    check_choice("AMPPrecision", "lr_on_skip", lr_on_skip, ("hold", "advance"), "use 'hold'.")


def check_fit_start(
    model: nn.Module, optimizers: list[Optimizer], device: str, dtype: torch.dtype, grad_scaling: bool
) -> None:
    """Refuse a setup that would fail later (``ValueError``); warn about one that would mislead.

    Refused: LBFGS under loss scaling, and the errors of
    :func:`~amp_plugin.diagnostics.check_optimizer_setup`; its warnings, and a plain
    ``nn.DataParallel`` under bf16 (its replicas would run fp16), are warned about.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> check_fit_start(model, [torch.optim.SGD(model.parameters())], "cpu", torch.float16, True)
        >>> check_fit_start(model, [torch.optim.LBFGS(model.parameters())], "cpu", torch.float16, True)
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision('16-mixed') cannot drive LBFGS: ... HINT: use precision='bf16-mixed' ...
    """
    if grad_scaling and any(isinstance(unwrap_optimizer(o), LBFGS) for o in optimizers):
        raise ValueError(
            "AMPPrecision('16-mixed') cannot drive LBFGS: it evaluates its closure several times per "
            "step, which loss scaling cannot skip safely. HINT: use precision='bf16-mixed' or another "
            "optimizer."
        )
    findings = diagnostics.check_optimizer_setup(
        model, optimizers, device_type=device, dtype=dtype, grad_scaling=grad_scaling
    )
    errors = [f.message for f in findings if f.severity == "error"]
    if errors:
        raise ValueError("AMPPrecision found problems at fit start:\n- " + "\n- ".join(errors))
    # stacklevel=5: the warnings name the caller's line (AMPPrecision.connect), not this helper's.
    for finding in findings:
        rank_zero_warn(finding.message, stacklevel=5)
    if dtype == torch.bfloat16 and (names := autocast.find_data_parallel(model)):
        rank_zero_warn(
            f"{', '.join(names)} is a plain nn.DataParallel: its replica threads would run fp16, not "
            "bf16 (torch re-enters only 'autocast enabled' there). HINT: wrap with "
            "amp_plugin.AutocastDataParallel instead.",
            stacklevel=5,
        )


def lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper (DDP, ...), or ``model`` itself.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> module = BoringModel()
        >>> wrapper = torch.nn.Module()
        >>> wrapper.module = module
        >>> lightning_module(wrapper) is module, lightning_module(module) is module
        (True, True)
    """
    for _ in range(4):
        inner = getattr(model, "module", None)
        if isinstance(model, LightningModule) or not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def module_device(model: nn.Module) -> str:
    """The device type of ``model`` (its ``.device``, else its first parameter's; ``"cpu"`` without any).

    Example:
        >>> module_device(torch.nn.Linear(2, 1)), module_device(torch.nn.ReLU())
        ('cpu', 'cpu')
    """
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device.type
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def hooks_observe_gradients(model: LightningModule, trainer: Trainer) -> bool:
    """Whether the module or a callback can look at gradients between backward and step.

    That is, whether the module overrides ``on_before_optimizer_step`` or
    ``configure_gradient_clipping``, or a callback overrides ``on_before_optimizer_step``.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Observer(Callback):
        ...     def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ...         pass
        >>> trainer = Trainer(accelerator="cpu", logger=False, callbacks=[Observer()])
        >>> hooks_observe_gradients(BoringModel(), trainer)
        True
        >>> hooks_observe_gradients(BoringModel(), Trainer(accelerator="cpu", logger=False))
        False
    """
    if any(is_overridden(hook, model, LightningModule) for hook in _OBSERVING_HOOKS):
        return True
    return any(
        is_overridden("on_before_optimizer_step", cb, Callback) for cb in getattr(trainer, "callbacks", [])
    )
