"""Precision strings, autocast state across threads, ``AutocastDataParallel`` and fp32 modules.

Autocast state (enabled and dtype per device type, plus the weight-cache flag) is
thread-local. torch's ``parallel_apply`` re-enters only "enabled" in replica threads, so
bf16 silently becomes fp16 in ``nn.DataParallel`` replicas; this module carries the whole
state instead. Plain torch: nothing here imports Lightning or initialises a device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Literal, ParamSpec, TypeVar, cast, get_args

import torch
from torch import nn
from torch.nn.parallel import parallel_apply as _torch_parallel_apply
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import autocast_device_types, check_device_type, fail

Precision = Literal["16-mixed", "bf16-mixed", "auto"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

_P = ParamSpec("_P")
_R = TypeVar("_R")

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_TO_MIXED = "this plugin does mixed precision (fp32 weights): use '16-mixed' or 'bf16-mixed'"
# Common near misses (Lightning spellings, dtype names) and the string they meant.
_HINTS = {
    **dict.fromkeys(("16", "fp16", "float16", "half", "torch.float16"), "use '16-mixed' for fp16 autocast"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "use 'bf16-mixed' for bf16 autocast"),
    **dict.fromkeys(("16-true", "bf16-true", "transformer-engine"), _TO_MIXED),
    **dict.fromkeys(("32", "32-true", "64", "64-true"), "for full precision drop the AMP plugin"),
}
# Device types that compute natively in bf16; torch's default autocast dtype there is bf16 too.
_BF16_NATIVE = frozenset({"cpu", "hpu", "xla", "maia"})


def check_device(device: object, call: str) -> str:
    """The device type named by ``device`` (a ``str`` or ``torch.device``) if autocast has it.

    An index is dropped (``"cuda:0"`` and ``torch.device("cuda", 0)`` give ``"cuda"``). Whether
    such a device is present is not checked here. ``call`` names the entry point in the message.

    Raises:
        TypeError: ``device`` is neither a ``str`` nor a ``torch.device``.
        ValueError: it names no device type that has autocast (``"gpu"``, ``""``, ``"meta"``, ...).

    Example:
        >>> check_device("cuda:0", "AMPPrecision"), check_device(torch.device("cpu"), "AMPPrecision")
        ('cuda', 'cpu')
    """
    return check_device_type(call, "device", device)


def _supported_dtypes(device_type: str) -> list[torch.dtype]:
    # As torch.autocast decides: a PrivateUse1 backend declares its dtypes, every other type takes both.
    if device_type == torch._C._get_privateuse1_backend_name():
        getter = getattr(getattr(torch, device_type, None), "get_amp_supported_dtype", None)
        return list(getter()) if getter is not None else []
    return [torch.bfloat16, torch.float16]


def _auto_choice(device_type: str) -> tuple[torch.dtype, str]:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return torch.float16, "fp16: CUDA is not available, so its capability is unknown"
        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            return torch.bfloat16, f"bf16: CUDA device with compute capability {major}.{minor} >= 8.0"
        return torch.float16, f"fp16: CUDA device with compute capability {major}.{minor} < 8.0 (no bf16)"
    native = device_type in _BF16_NATIVE or (device_type == "xpu" and torch.xpu.is_bf16_supported())
    if native or torch.float16 not in _supported_dtypes(device_type):
        return torch.bfloat16, f"bf16: {device_type.upper()} autocast supports bf16"
    return torch.float16, f"fp16: no bf16 capability check for device type {device_type!r}"


def auto_precision_reason(device_type: str | torch.device) -> str:
    """Say, in words, which dtype ``"auto"`` picks on ``device_type`` and why.

    Initialises only the device type asked about (CUDA only for ``"cuda"``).

    Example:
        >>> auto_precision_reason("cpu")
        'bf16: CPU autocast supports bf16'
    """
    return _auto_choice(check_device_type("auto_precision_reason", "device_type", device_type))[1]


def check_precision(precision: object) -> Precision:
    """Validate a precision string; raise ``ValueError`` with the allowed values and a hint."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        hint = _HINTS.get(str(precision).strip().lower(), "pick one of the allowed strings")
        raise ValueError(f"Unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}. HINT: {hint}.")
    return precision  # type: ignore[return-value]


def resolve_precision(precision: str, device_type: str | torch.device) -> torch.dtype:
    """Turn a precision string into the autocast dtype for ``device_type``.

    ``"16-mixed"`` is fp16 and ``"bf16-mixed"`` bf16, on every device type that supports
    them (fp16 on CPU included, unlike Lightning, which turns it into bf16). ``"auto"``
    picks bf16 where the device has it (CPU; CUDA compute capability >= 8.0), else fp16.
    ``device_type`` is checked by :func:`check_device` (``"cuda:0"`` counts as ``"cuda"``).

    Raises:
        ValueError: unknown precision string, a device type without autocast, or a dtype
            the device's autocast cannot run.
        TypeError: ``device_type`` is neither a ``str`` nor a ``torch.device``.

    Example:
        >>> resolve_precision("16-mixed", "cpu")
        torch.float16
        >>> resolve_precision("auto", "cpu")
        torch.bfloat16
    """
    check_precision(precision)
    device_type = check_device_type("resolve_precision", "device_type", device_type)
    dtype = _auto_choice(device_type)[0] if precision == "auto" else _DTYPES[precision]
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"precision={precision!r} on device type 'cuda', but CUDA is not available. "
            "HINT: run on a machine with a CUDA GPU and a CUDA build of torch, or use device type 'cpu'."
        )
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision={precision!r}, but this CUDA device has no bf16 support. HINT: use '16-mixed'."
        )
    supported = _supported_dtypes(device_type)
    if dtype not in supported:
        other = "'bf16-mixed'" if torch.bfloat16 in supported else "another device type"
        raise ValueError(
            f"precision={precision!r} needs {dtype} autocast, but {device_type!r} autocast supports "
            f"only {supported}. HINT: use {other}."
        )
    return dtype


@dataclass(frozen=True)
class DeviceAutocast:
    """Autocast state of one device type: whether it is on and the dtype it casts to."""

    device_type: str
    enabled: bool
    dtype: torch.dtype


@dataclass(frozen=True)
class AutocastState:
    """A snapshot of one thread's autocast state, for re-entering in another thread.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     state = autocast_state()
        >>> with state.apply():
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.float16
    """

    devices: tuple[DeviceAutocast, ...]
    cache_enabled: bool

    def device(self, device_type: str | torch.device) -> DeviceAutocast:
        """The captured state of ``device_type``, checked as by :func:`check_device`."""
        wanted = check_device_type("AutocastState.device", "device_type", device_type)
        return {d.device_type: d for d in self.devices}[wanted]  # KeyError: a backend registered since

    def disabled(self) -> AutocastState:
        """The same state with autocast off for every device type (dtypes kept)."""
        return replace(self, devices=tuple(replace(d, enabled=False) for d in self.devices))

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """Run the body under exactly this state, then restore the previous one (nesting-safe)."""
        previous = autocast_state()
        self._set()
        # Counted like torch.autocast, so the cast-weight cache is cleared when the outermost region ends.
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            previous._set()

    def _set(self) -> None:
        for entry in self.devices:
            torch.set_autocast_enabled(entry.device_type, entry.enabled)
            torch.set_autocast_dtype(entry.device_type, entry.dtype)
        torch.set_autocast_cache_enabled(self.cache_enabled)


def autocast_state() -> AutocastState:
    """Capture the calling thread's autocast state (every device type, and the cache flag).

    Reads thread-local flags only: CUDA is not initialised.

    Example:
        >>> autocast_state().device("cpu").enabled
        False
    """
    devices = tuple(
        DeviceAutocast(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in autocast_device_types()
    )
    return AutocastState(devices, torch.is_autocast_cache_enabled())


def _run_under(state: AutocastState, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    with state.apply():
        return fn(*args, **kwargs)


def propagate_autocast(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wrap ``fn`` so that, called in any thread, it runs under the autocast state of the wrapping thread.

    Example:
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     matmul = propagate_autocast(torch.mm)
        >>> with ThreadPoolExecutor(1) as pool:
        ...     pool.submit(matmul, torch.ones(2, 2), torch.ones(2, 2)).result().dtype
        torch.float16
    """
    given: object = fn  # typed callers cannot pass anything else; untyped ones can
    if not callable(given):
        got = f"fn={given!r}" if given is None or isinstance(given, str) else f"fn={type(given).__name__}"
        hint = "pass the function itself, e.g. propagate_autocast(step)."
        fail("propagate_autocast", got, "a callable", hint, TypeError)
    state = autocast_state()

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return _run_under(state, fn, *args, **kwargs)

    return wrapper


class AutocastDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """``nn.DataParallel`` whose replica threads run under the caller's full autocast state.

    Same arguments as ``nn.DataParallel``. Without GPUs it calls the module directly.

    Example:
        >>> model = AutocastDataParallel(torch.nn.Linear(2, 2))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.ones(1, 2)).dtype
        torch.bfloat16
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        given: object = module  # without GPUs nn.DataParallel would keep anything and fail in forward
        if not isinstance(given, nn.Module):
            hint = "pass the model instance (a class must be instantiated first)."
            fail(
                "AutocastDataParallel", f"module={given!r:.80}", "a torch.nn.Module instance", hint, TypeError
            )
        super().__init__(module, *args, **kwargs)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        state = autocast_state()
        # torch's fan-out only calls each entry, so a callable can stand in for its replica;
        # torch's own `autocast(enabled=...)` is entered first and ours overrides it inside.
        calls = [functools.partial(_run_under, state, replica) for replica in replicas]
        devices = self.device_ids[: len(replicas)]
        return _torch_parallel_apply(cast(Sequence[nn.Module], calls), inputs, kwargs, devices)


def find_data_parallel(module: nn.Module) -> list[str]:
    """Names of the plain ``nn.DataParallel`` modules in ``module`` (the root is ``""``).

    These lose a bf16 autocast dtype in their replicas; ``AutocastDataParallel`` does not.

    Example:
        >>> find_data_parallel(torch.nn.Sequential(torch.nn.DataParallel(torch.nn.Linear(2, 2))))
        ['0']
    """
    if not isinstance(module, nn.Module):
        fail("find_data_parallel", f"module={type(module).__name__}", "a torch.nn.Module",
             "pass the model itself.", TypeError)  # fmt: skip
    return [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.DataParallel) and not isinstance(sub, AutocastDataParallel)
    ]


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
