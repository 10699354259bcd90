"""What runs in fp32 under autocast: chosen module classes, with autocast off and inputs cast up.

:func:`force_fp32` hooks every submodule of a model that is an instance of the given classes
(``AMPPrecision(fp32_modules=...)`` calls it); :func:`check_module_classes` validates such a
list. Plain torch: nothing here imports Lightning or initialises a device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import fail
from amp_plugin.autocast import autocast_state

__all__ = ["Fp32Modules", "check_module_classes", "force_fp32"]


def _to_fp32(value: Any) -> Any:
    # Like torch.amp.custom_fwd(cast_inputs=float32): fp64 stays as it is, only lower precision rises.
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_fp32(v)) for k, v in value.items())
    return value


class _Regions(threading.local):
    def __init__(self) -> None:  # runs once in every thread that touches the object
        self.stack: list[tuple[nn.Module, AbstractContextManager[None]]] = []


class Fp32Modules:
    """Hooks that run chosen modules in fp32 with autocast off; made by :func:`force_fp32`.

    Attributes:
        names: the names of the modules that got hooks (the root is ``""``).

    Example:
        >>> force_fp32(torch.nn.Sequential(torch.nn.LayerNorm(2)), (torch.nn.LayerNorm,)).names
        ('0',)
    """

    def __init__(self, model: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
        # DataParallel replicas share these hooks, so each thread keeps its own stack of open regions.
        self._regions = _Regions()
        self._handles: list[RemovableHandle] = []
        matched = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
        self.names: tuple[str, ...] = tuple(name for name, _ in matched)
        for _, module in matched:
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, with_kwargs=True, always_call=True))

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        region = autocast_state().disabled().apply()
        region.__enter__()
        # Pushed before casting: if casting raises, the always-called exit hook still closes it.
        self._regions.stack.append((module, region))
        return _to_fp32(args), _to_fp32(kwargs)

    def _exit(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        stack = self._regions.stack
        # After an error in an earlier pre-hook ours never ran, and the top of the stack is not ours.
        if stack and stack[-1][0] is module:
            stack.pop()[1].__exit__(None, None, None)

    def remove(self) -> None:
        """Remove every hook; modules then run under the surrounding autocast again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def check_module_classes(classes: object) -> tuple[type[nn.Module], ...]:
    """Validate a sequence of module classes (``fp32_modules``); return it as a tuple.

    Raises:
        TypeError: not a tuple or list, or an item that is not a ``torch.nn.Module`` subclass; the
            hint names the first such item (an instance, a name, a class of another kind).

    Example:
        >>> check_module_classes([torch.nn.LayerNorm])
        (<class 'torch.nn.modules.normalization.LayerNorm'>,)
    """
    if isinstance(classes, (tuple, list)):
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not bad:
            return tuple(classes)
        hint = _class_hint(bad[0])
    elif isinstance(classes, type) and issubclass(classes, nn.Module):
        hint = f"wrap the class in a tuple: ({classes.__name__},)."
    else:
        hint = "pass a tuple (or list), e.g. (torch.nn.LayerNorm,)."
    raise TypeError(f"got classes={classes!r}; allowed: a tuple of torch.nn.Module subclasses. HINT: {hint}")


def _class_hint(item: object) -> str:
    if isinstance(item, nn.Module):
        return f"{item!r} is an instance; pass its class, {type(item).__name__}."
    if isinstance(item, type):
        return f"{item.__name__} is not a torch.nn.Module subclass; pass module classes only."
    return f"{item!r} is not a class; pass the class itself, e.g. torch.nn.LayerNorm."


def force_fp32(model: nn.Module, classes: Sequence[type[nn.Module]]) -> Fp32Modules:
    """Run every submodule of ``model`` that is an instance of ``classes`` in fp32, autocast off.

    Inside such a module autocast is disabled for every device type and floating-point
    tensor inputs (in args and kwargs, nested in tuples, lists and dicts; fp64 excepted) are
    cast to fp32. Outputs stay fp32; later autocast ops cast them as they need. Nested and
    threaded (DataParallel) calls are safe. Assumes the module's parameters are fp32.

    Raises:
        TypeError: ``model`` is not a module, or ``classes`` is not a sequence of module classes.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> hooks = force_fp32(model, (torch.nn.LayerNorm,))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.ones(1, 2)).dtype
        torch.float32
        >>> hooks.remove()
    """
    if not isinstance(model, nn.Module):
        fail("force_fp32", f"model={model!r:.80}", "a torch.nn.Module", "pass the model.", TypeError)
    return Fp32Modules(model, check_module_classes(classes))
