"""Autocast state across threads, and ``AutocastDataParallel``.

Autocast state (enabled and dtype per device type, plus the weight-cache flag) is
thread-local. torch's ``parallel_apply`` re-enters only "enabled" in replica threads, so
bf16 silently becomes fp16 in ``nn.DataParallel`` replicas; this module carries the whole
state instead, together with the torch function modes that ask to be carried (such as
:class:`~amp_plugin.fp32_policy.Fp32Functions`). Plain torch: nothing here imports Lightning or
initialises a device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar, cast

import torch
from torch import nn
from torch.nn.parallel import parallel_apply as _torch_parallel_apply
from torch.overrides import TorchFunctionMode

from amp_plugin._validation import autocast_device_types, check_device_type, check_module, fail

__all__ = ["AutocastState", "CarriedFunctionMode", "find_data_parallel"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Carried(threading.local):
    def __init__(self) -> None:  # runs once in every thread that touches the object
        self.modes: list[CarriedFunctionMode] = []


# Mirrors torch's own thread-local mode stack for the modes below (torch offers no public read of it).
_CARRIED = _Carried()


class CarriedFunctionMode(TorchFunctionMode):
    """A torch function mode that :func:`autocast_state` captures and :meth:`AutocastState.apply` re-enters.

    So :func:`propagate_autocast` and :class:`AutocastDataParallel` carry it into other threads,
    where torch's mode stack (thread-local) would lose it. Subclasses define ``__torch_function__``.

    Example:
        >>> class Count(CarriedFunctionMode):
        ...     calls = 0
        ...     def __torch_function__(self, func, types, args=(), kwargs=None):
        ...         Count.calls += 1
        ...         return func(*args, **(kwargs or {}))
        >>> with Count():
        ...     state = autocast_state()
        >>> with state.apply():
        ...     _ = torch.ones(1) + 1
        >>> Count.calls
        2
    """

    def __enter__(self) -> CarriedFunctionMode:
        super().__enter__()
        _CARRIED.modes.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _CARRIED.modes.pop()  # torch's mode stack is strictly nested, and so is this one
        super().__exit__(*exc_info)


@dataclass(frozen=True)
class DeviceAutocast:
    """Autocast state of one device type: whether it is on and the dtype it casts to.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     autocast_state().device("cpu")
        DeviceAutocast(device_type='cpu', enabled=True, dtype=torch.float16)
    """

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
    modes: tuple[CarriedFunctionMode, ...] = ()

    def device(self, device_type: str | torch.device) -> DeviceAutocast:
        """The captured state of ``device_type``, checked as by :func:`~amp_plugin.precision.check_device`."""
        wanted = check_device_type("AutocastState.device", "device_type", device_type)
        return {d.device_type: d for d in self.devices}[wanted]  # KeyError: a backend registered since

    def disabled(self) -> AutocastState:
        """The same state with autocast off for every device type (dtypes kept)."""
        return replace(self, devices=tuple(replace(d, enabled=False) for d in self.devices))

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """Run the body under exactly this state, then restore the previous one (nesting-safe).

        Captured modes not active in the calling thread are entered for the body; active ones are
        not entered twice.
        """
        previous = autocast_state()
        missing = [m for m in self.modes if not any(m is active for active in previous.modes)]
        self._set()
        # Counted like torch.autocast, so the cast-weight cache is cleared when the outermost region ends.
        torch.autocast_increment_nesting()
        try:
            with contextlib.ExitStack() as modes:
                for mode in missing:
                    modes.enter_context(mode)
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
    """Capture the calling thread's autocast state (every device type, the cache flag, carried modes).

    Reads thread-local flags only: CUDA is not initialised.

    Example:
        >>> autocast_state().device("cpu").enabled
        False
    """
    devices = tuple(
        DeviceAutocast(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in autocast_device_types()
    )
    return AutocastState(devices, torch.is_autocast_cache_enabled(), tuple(_CARRIED.modes))


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
        fail("propagate_autocast", passed=got, allowed="a callable", hint=hint, error=TypeError)
    state = autocast_state()

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return _run_under(state, fn, *args, **kwargs)

    return wrapper


class AutocastDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """``nn.DataParallel`` whose replica threads run under the caller's full autocast state.

    Same arguments as ``nn.DataParallel``. Without GPUs it calls the module directly; with them,
    like ``nn.DataParallel``, it needs the module on the first of its ``device_ids``.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> model = AutocastDataParallel(torch.nn.Linear(2, 2).to(device))
        >>> with torch.autocast(device, dtype=torch.bfloat16):
        ...     model(torch.ones(1, 2, device=device)).dtype
        torch.bfloat16
    """

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        given: object = module  # without GPUs nn.DataParallel would keep anything and fail in forward
        if not isinstance(given, nn.Module):
            hint = "pass the model instance (a class must be instantiated first)."
            fail(
                "AutocastDataParallel",
                passed=f"module={given!r:.80}",
                allowed="a torch.nn.Module instance",
                hint=hint,
                error=TypeError,
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
    check_module("find_data_parallel", "module", module, hint="pass the model itself.")
    return [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.DataParallel) and not isinstance(sub, AutocastDataParallel)
    ]
