"""Optional-dependency probes, evaluated lazily and cached.

Nothing here runs at import time: ``import amp_plugin`` must never import Apex or
initialise CUDA. The Apex probe looks for the compiled ``amp_C`` extension and
``apex.multi_tensor_apply``, never for the bare ``apex`` name (the PyPI package called
``apex`` is an unrelated web toolkit).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

APEX_HINT = (
    "Build NVIDIA Apex from source with its CUDA extensions: "
    "`pip install -v --no-build-isolation --config-settings '--build-option=--cuda_ext' "
    "git+https://github.com/NVIDIA/apex` (the PyPI package named `apex` is unrelated)."
)


@functools.cache
def apex_error() -> str | None:
    """Why the Apex ``amp_C`` kernels cannot be used, or ``None`` when they can."""
    try:
        importlib.import_module("amp_C")
        importlib.import_module("apex.multi_tensor_apply")
    except Exception as err:  # an ImportError, or a broken CUDA build raising anything else
        return f"{type(err).__name__}: {err}"
    return None


def apex_available() -> bool:
    """``True`` when ``amp_C`` and ``apex.multi_tensor_apply`` both import."""
    return apex_error() is None


def import_amp_c() -> tuple[Any, Any]:
    """Return ``(amp_C, multi_tensor_applier)``; raise ``ImportError`` with a hint when missing."""
    reason = apex_error()
    if reason is not None:
        raise ImportError(f"NVIDIA Apex `amp_C` is not importable ({reason}). HINT: {APEX_HINT}")
    amp_c = importlib.import_module("amp_C")
    applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
    return amp_c, applier


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
