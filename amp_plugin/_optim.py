"""Optimizer helpers shared by the scaler, the plugin and the diagnostics.

Wrappers such as Lightning's ``LightningOptimizer`` hold the real optimizer in
``._optimizer`` or ``.optimizer``; per-optimizer state must be keyed on the real one, or
unscaling the wrapper and then the inner optimizer would unscale twice.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GRAD_SCALER_KWARG_WARNING",
    "gradients_to_unscale",
    "handles_unscaling",
    "step_with_amp_attributes",
    "takes_grad_scaler",
    "unwrap_optimizer",
]

GRAD_SCALER_KWARG_WARNING = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the near "
    "future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed optimizer and "
    "let the optimizer use them directly."
)  # torch's words, so that warning filters written for GradScaler match ours too


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer behind wrappers that hold it in ``._optimizer`` / ``.optimizer``.

    Lightning's ``LightningOptimizer`` is itself an ``Optimizer`` subclass, so the unwrap
    follows the attributes rather than stopping at the first ``Optimizer``.

    Raises:
        TypeError: ``optimizer`` is not an optimizer (it has no ``param_groups`` and ``step``).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> class Wrapper:
        ...     def __init__(self, optimizer):
        ...         self.optimizer = optimizer
        >>> unwrap_optimizer(Wrapper(opt)) is opt
        True
    """
    if type(optimizer) in _TORCH_OPTIMIZERS:  # per step, several times: the common case costs one lookup
        return optimizer
    for _ in range(16):
        inner = getattr(optimizer, "_optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"Expected a torch.optim.Optimizer (or a wrapper holding one in .optimizer/._optimizer), got "
            f"{type(optimizer).__qualname__}. HINT: pass the optimizer that owns the parameters."
        )
    return optimizer


_TORCH_OPTIMIZERS = frozenset(
    cls
    for cls in vars(torch.optim).values()
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
)  # torch's own classes, which wrap nothing (a subclass of one is unwrapped by its attributes)


def handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales and skips inside its own ``step()`` (``_step_supports_amp_scaling``).

    torch's ``fused=True`` Adam, AdamW, SGD and Adagrad do: they read ``grad_scale`` and
    ``found_inf`` attributes that the scaler sets before ``step()``.

    Example:
        >>> import torch
        >>> params = torch.nn.Linear(1, 1).parameters()
        >>> handles_unscaling(torch.optim.AdamW(params, fused=True))
        True
    """
    return bool(getattr(unwrap_optimizer(optimizer), "_step_supports_amp_scaling", False))


def gradients_to_unscale(optimizer: Any) -> list[Tensor]:
    """The tensors that hold ``optimizer``'s gradient values, for an in-place unscale and inf check.

    A dense gradient is itself; a sparse COO gradient contributes its ``_values()`` (an fp16
    one is coalesced first, replacing ``.grad``, so that duplicate indices cannot hide an
    overflow that their sum would produce), as torch's GradScaler does.

    Example:
        >>> import torch
        >>> emb = torch.nn.Embedding(4, 2, sparse=True)
        >>> emb(torch.tensor([1, 1])).sum().backward()
        >>> [t.shape for t in gradients_to_unscale(torch.optim.SGD(emb.parameters(), lr=0.1))]
        [torch.Size([2, 2])]
    """
    tensors: list[Tensor] = []
    for group in unwrap_optimizer(optimizer).param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                tensors.append(grad._values())
            else:
                tensors.append(grad)
    return tensors


def takes_grad_scaler(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` takes a ``grad_scaler=`` argument (torch's older fused contract).

    Example:
        >>> import torch
        >>> takes_grad_scaler(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
        False
    """
    step = unwrap_optimizer(optimizer).step
    function = getattr(step, "__func__", step)  # one entry per step function, not per optimizer
    try:
        return _TAKES_GRAD_SCALER[function]
    except (KeyError, TypeError):  # TypeError: a callable that takes no weak reference
        pass
    takes = "grad_scaler" in inspect.signature(step).parameters  # tens of microseconds: asked once
    with contextlib.suppress(TypeError):
        _TAKES_GRAD_SCALER[function] = takes
    return takes


_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def step_with_amp_attributes(
    opt: Any, optimizer: Any, grad_scale: Tensor | None, found_inf: Tensor | None, *args: Any, **kwargs: Any
) -> Any:
    """Run ``optimizer.step`` with ``grad_scale``/``found_inf`` set on ``opt`` (the real optimizer).

    The contract of optimizers with ``_step_supports_amp_scaling``: the step divides the
    gradients by ``grad_scale`` and skips where ``found_inf`` is set. The attributes are
    removed afterwards, also when the step raises.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.full((2,), 4.0)
        >>> opt = torch.optim.SGD([p], lr=1.0, fused=True)
        >>> _ = step_with_amp_attributes(opt, opt, torch.tensor(4.0), torch.zeros(()))
        >>> p.tolist(), hasattr(opt, "grad_scale")
        ([0.0, 0.0], False)
    """
    opt.grad_scale, opt.found_inf = grad_scale, found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del opt.grad_scale, opt.found_inf
