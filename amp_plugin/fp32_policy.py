"""What runs in fp32 under autocast: chosen module classes and torch functions, autocast off, inputs cast up.

:func:`force_fp32` hooks every submodule of a model that is an instance of the given classes
(``AMPPrecision(fp32_modules=...)`` calls it); :func:`check_module_classes` validates such a
list. :class:`Fp32Functions` is a context manager (a torch function mode, nothing patched) that
runs chosen torch functions in fp32 (``AMPPrecision(fp32_functions=...)`` enters it);
:func:`check_functions` validates them. Plain torch: nothing here imports Lightning or
initialises a device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import autocast_device_types, fail
from amp_plugin.autocast import CarriedFunctionMode, autocast_state
from amp_plugin.precision import default_dtype

__all__ = ["Fp32Functions", "check_functions", "force_fp32"]


def _to_fp32(value: Any) -> Any:
    # Like torch.amp.custom_fwd(cast_inputs=float32): fp64 stays as it is, only lower precision rises.
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        # The mapping's own copy() keeps a defaultdict (and its factory) or an OrderedDict, and
        # torch.compile traces it (copy.copy it does not).
        copied = value.copy()
        for k, v in value.items():
            copied[k] = _to_fp32(v)
        return copied
    return value


class _Regions(threading.local):
    def __init__(self) -> None:  # runs once in every thread that touches the object
        self.stack: list[tuple[nn.Module, ExitStack]] = []


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

    def __getstate__(self) -> dict[str, Any]:
        # The open regions belong to the threads of this process (none between forward passes); a
        # copy (a pickled plugin in a spawned process, a deep-copied model) starts without any.
        return {k: v for k, v in self.__dict__.items() if k != "_regions"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._regions = _Regions()

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        region = ExitStack()
        region.enter_context(autocast_state().disabled().apply())
        if torch.get_default_dtype() in (torch.float16, torch.bfloat16):
            # A "-true" forward made half the default dtype; tensors the module makes are fp32 too.
            region.enter_context(default_dtype(torch.float32))
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


def check_module_classes(
    classes: object, call: str = "check_module_classes", name: str = "classes"
) -> tuple[type[nn.Module], ...]:
    """Validate a sequence of module classes (``fp32_modules``); return it as a tuple.

    ``call`` and ``name`` are the entry point and the argument the user wrote, for the error
    message (``AMPPrecision(fp32_modules=...)``).

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
    fail(
        call,
        passed=f"{name}={classes!r}",
        allowed="a tuple of torch.nn.Module subclasses",
        hint=hint,
        error=TypeError,
    )


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
    cast to fp32, in copies of the containers (a ``defaultdict`` or an ``OrderedDict`` stays one).
    Outputs stay fp32; later autocast ops cast them as they need. Nested and
    threaded (DataParallel) calls are safe. Assumes the module's parameters are fp32. Where torch's
    default dtype is fp16 or bf16 (the forward pass of a "-true" precision), it is fp32 inside
    such a module, so the tensors the module makes are fp32 too (the default dtype is
    process-wide, so this part is not kept apart per thread).

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
        fail(
            "force_fp32",
            passed=f"model={model!r:.80}",
            allowed="a torch.nn.Module",
            hint="pass the model.",
            error=TypeError,
        )
    return Fp32Modules(model, check_module_classes(classes, "force_fp32"))


def check_functions(
    functions: object, call: str = "Fp32Functions", name: str = "functions"
) -> tuple[Callable[..., Any], ...]:
    """Validate torch functions to run in fp32 (``fp32_functions``); return them as a tuple, deduplicated.

    Accepted: one function or a tuple (or list) of them, each a function torch dispatches through
    ``__torch_function__``: ``torch.*`` functions (``torch.sigmoid``), Tensor methods
    (``torch.Tensor.softmax``) and ``torch.nn.functional`` functions (``F.gelu``). ``call`` and
    ``name`` say in the message where the value was passed.

    Raises:
        TypeError: a name instead of the function, a class, something not callable, an in-place
            function (``torch.Tensor.sigmoid_``, ``torch.Tensor.__iadd__``, ``torch.Tensor.__setitem__``),
            or a callable torch never dispatches (your own function); the hint names the first such item.

    Example:
        >>> check_functions([torch.sigmoid, torch.Tensor.softmax, torch.sigmoid])
        (<built-in method sigmoid of type object at ...>, <method 'softmax' of 'torch._C.TensorBase' objects>)
    """
    if callable(functions) and not isinstance(functions, type):
        functions = (functions,)
    if not isinstance(functions, (tuple, list)):
        hint = (
            "pass the function itself, e.g. torch.sigmoid."
            if isinstance(functions, str)
            else "pass a tuple (or list) of functions, e.g. (torch.sigmoid, torch.Tensor.softmax)."
        )
        fail(
            call,
            passed=f"{name}={functions!r:.80}",
            allowed="a torch function or a tuple of them",
            hint=hint,
            error=TypeError,
        )
    for item in functions:
        hint = _function_hint(item)
        if hint:
            allowed = "functions torch dispatches (torch.*, Tensor methods, F.*)"
            fail(call, passed=f"{name}={functions!r:.120}", allowed=allowed, hint=hint, error=TypeError)
    return tuple(dict.fromkeys(functions))


def _function_hint(item: object) -> str:
    if isinstance(item, str):
        return f"{item!r} is a name; pass the function itself, e.g. torch.{item.rpartition('.')[2]}."
    if isinstance(item, type):
        return (
            f"{item.__name__} is a class; for a module class use fp32_modules=, for its function "
            "pass the function, e.g. torch.sigmoid."
        )
    if not callable(item):
        return f"{item!r:.60} is not callable; pass functions such as torch.sigmoid."
    name = getattr(item, "__name__", "")
    if name == "__setitem__":
        return (
            "__setitem__ (x[i] = v) writes into the tensor, so it would write into an fp32 copy of a half "
            "tensor; leave it out, and register the function that computes v instead."
        )
    if name.endswith("_") and not name.endswith("__"):
        out_of_place = name[:-1]
    elif name.startswith("__i") and name.endswith("__") and hasattr(torch.Tensor, f"__{name[3:]}"):
        out_of_place = f"__{name[3:]}"  # x <<= y is __ilshift__, x << y __lshift__
    else:
        out_of_place = ""
    if out_of_place:
        return (
            f"{name} works in place: it would change an fp32 copy of a half tensor, not the tensor. "
            f"Register the out-of-place function (e.g. {out_of_place})."
        )
    if item not in _dispatched():
        return (
            f"torch does not dispatch {item!r:.60} through __torch_function__, so no mode sees its calls; "
            "for your own function use @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32)."
        )
    return ""


@functools.cache
def _dispatched() -> frozenset[Callable[..., Any]]:
    # About 1,400 functions: a few ms the first time, then free (the plugin builds its mode per step).
    return frozenset(f for fs in torch.overrides.get_overridable_functions().values() for f in fs)


class Fp32Functions(CarriedFunctionMode):
    """Inside ``with Fp32Functions(functions):``, calls of those functions run in fp32 with autocast off.

    Floating-point tensor inputs of lower precision (in args and kwargs, nested in tuples,
    lists and dicts; fp64 and an ``out=`` tensor excepted) are cast to fp32, so results are
    fp32 (except into a half ``out=``); gradients flow back in the inputs' dtypes. Every other
    call passes through unchanged, and so does a call with ``inplace=True`` (``F.relu(x, inplace=True)``,
    what ``nn.ReLU(inplace=True)`` makes), which must write into ``x`` itself. A function counts only as
    the object registered: ``torch.sigmoid`` does not cover ``x.sigmoid()`` (``torch.Tensor.sigmoid``).
    Re-entrant and nestable; :func:`~amp_plugin.autocast.propagate_autocast` and
    :class:`~amp_plugin.autocast.AutocastDataParallel` carry it into their threads.
    Torch is not patched: the mode acts only in the thread and region that entered it.

    Attributes:
        functions: the registered functions, validated by :func:`check_functions`.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions((torch.sigmoid,)):
        ...     hidden = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        ...     hidden.dtype, torch.sigmoid(hidden).dtype, torch.tanh(hidden).dtype
        (torch.bfloat16, torch.float32, torch.bfloat16)
    """

    def __init__(self, functions: Callable[..., Any] | Sequence[Callable[..., Any]]) -> None:
        super().__init__()
        self.functions = check_functions(functions)
        self._registered = frozenset(self.functions)
        self._device_types = autocast_device_types()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func not in self._registered or (kwargs and kwargs.get("inplace")):
            # F.relu(x, inplace=True) writes into x: on an fp32 copy the write would be lost.
            return func(*args, **(kwargs or {}))
        # Flags flipped by hand, not through AutocastState.apply: this runs per call, and a registered
        # call costs ~6 us instead of ~70 (benchmarks/fp32_functions.py). torch pops this mode while
        # its handler runs, so func does not come back here.
        enabled = [d for d in self._device_types if torch.is_autocast_enabled(d)]
        for device_type in enabled:
            torch.set_autocast_enabled(device_type, False)
        try:
            # out= is the caller's tensor, written in place: casting it would write into a copy.
            cast = {k: v if k == "out" else _to_fp32(v) for k, v in (kwargs or {}).items()}
            return func(*_to_fp32(tuple(args)), **cast)
        finally:
            for device_type in enabled:
                torch.set_autocast_enabled(device_type, True)

    def __repr__(self) -> str:
        names = (torch.overrides.resolve_name(f) or repr(f) for f in self.functions)
        return f"Fp32Functions({', '.join(names)})"
