"""Kernel backends behind one small interface, chosen lazily.

``get_kernels("torch")`` always works. ``get_kernels("apex")`` needs NVIDIA Apex's
compiled ``amp_C`` extension and CUDA tensors. ``get_kernels("auto", device)`` picks
Apex for a CUDA device when ``amp_C`` imports, else torch. Each backend is built on first use;
importing this package never imports Apex (``amp_C`` is imported when ``ApexKernels`` is built).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from amp_plugin import _imports
from amp_plugin._validation import device_hint, fail
from amp_plugin.kernels._apex import ApexKernels
from amp_plugin.kernels._base import Kernels
from amp_plugin.kernels._foreach import TorchKernels

__all__ = ["Backend", "Kernels"]

Backend = Literal["auto", "torch", "apex"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "apex")


def check_backend(backend: object, call: str = "get_kernels", name: str = "backend") -> Backend:
    """Validate a backend name; raise ``ValueError`` naming the allowed values.

    ``call`` and ``name`` say where the value was passed (``AMPPrecision(kernels=...)``).

    Example:
        >>> check_backend("apex")
        'apex'
        >>> check_backend("cuda")
        Traceback (most recent call last):
        ...
        ValueError: get_kernels(backend='cuda') is not allowed here: there is no such kernel backend. ...
    """
    if backend not in BACKENDS:
        fail(
            call,
            passed=f"{name}={backend!r}",
            why="there is no such kernel backend",
            allowed="one of " + ", ".join(map(repr, BACKENDS)),
            hint="use 'auto' to take Apex amp_C on CUDA when it is installed and torch otherwise.",
        )
    return backend  # type: ignore[return-value]


def get_kernels(backend: Backend = "auto", device: torch.device | str | None = None) -> Kernels:
    """Return the kernel backend for ``backend`` on ``device``.

    Args:
        backend: ``"torch"``, ``"apex"`` or ``"auto"``.
        device: where the tensors live; ``"auto"`` only picks Apex for CUDA devices.

    Raises:
        ValueError: unknown backend name, or a device string torch does not know (``"gpu"``).
        TypeError: ``device`` is neither ``None``, a ``str`` nor a ``torch.device``.
        RuntimeError: ``"apex"`` requested but ``amp_C`` does not import, or the device is not CUDA.

    Example:
        >>> from amp_plugin.kernels import get_kernels
        >>> get_kernels("auto", "cpu").name
        'torch'
    """
    backend = check_backend(backend)
    device_type = _device_type(device)
    if backend == "auto":
        use_apex = device_type == "cuda" and _imports.apex_available()
        return _apex_backend() if use_apex else _torch_backend()
    if backend == "apex":
        if not _imports.apex_available():
            raise RuntimeError(
                f"kernels='apex' was requested but NVIDIA Apex `amp_C` is not importable "
                f"({_imports.apex_error()}). HINT: {_imports.APEX_HINT} Or pass kernels='auto'."
            )
        if device_type not in (None, "cuda"):
            raise RuntimeError(
                f"kernels='apex' runs CUDA tensors only, but the tensors are on {device_type!r}. "
                "HINT: pass kernels='auto' to use the torch kernels off CUDA."
            )
        return _apex_backend()
    return _torch_backend()


def _device_type(device: object) -> str | None:
    if device is None:
        return None
    got = f"device={device!r}"
    allowed = "None, a torch.device or a device string such as 'cuda', 'cuda:0' or 'cpu'"
    if not isinstance(device, (str, torch.device)):
        fail(
            "get_kernels",
            passed=got,
            allowed=allowed,
            hint="pass the tensors' device, e.g. grads[0].device.",
            error=TypeError,
        )
    try:
        return torch.device(device).type
    except RuntimeError:  # torch's message lists every device type it knows, and no fix
        fail(
            "get_kernels",
            passed=got,
            why="torch knows no such device type",
            allowed=allowed,
            hint=device_hint(device),
        )


@functools.cache
def _torch_backend() -> Kernels:
    return TorchKernels()


@functools.cache
def _apex_backend() -> Kernels:
    return ApexKernels()
