"""What the Trainer's ``AMPPrecision`` reads of the model Lightning hands it at fit start.

The LightningModule inside a strategy's wrapper, and whether any hook can look at the gradients
between backward and step (which decides the fast clipping path under ``clip_fused="auto"``).
What every adapter checks at fit start is :mod:`amp_plugin._fit_start`'s.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

__all__ = ["backward_takes_gradient", "hooks_observe_gradients", "lightning_module"]

_OBSERVING_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")


def lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper (DDP, ...), or ``model`` itself.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> module = BoringModel()
        >>> wrapper = nn.Module()
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


def backward_takes_gradient(model: object) -> bool:
    """Whether ``model.backward`` is ``LightningModule.backward``, which hands ``gradient=`` on to the loss.

    An override may call ``loss.backward()`` its own way, so it gets a scaled loss instead.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Own(BoringModel):
        ...     def backward(self, loss, *args, **kwargs):
        ...         loss.backward()
        >>> backward_takes_gradient(BoringModel()), backward_takes_gradient(Own())
        (True, False)
    """
    own = getattr(type(model), "backward", None) is LightningModule.backward
    return own and "backward" not in getattr(model, "__dict__", {})
