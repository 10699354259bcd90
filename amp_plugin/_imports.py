"""Optional-dependency probes: ``lightning_utilities``' ``RequirementCache``, evaluated lazily.

Nothing here runs at import time: a ``RequirementCache`` only looks when it is asked, so
``import amp_plugin`` never imports Apex, Lightning or torchao nor initialises CUDA. The Apex probe
looks for the compiled ``amp_C`` extension and ``apex.multi_tensor_apply``, never for the bare
``apex`` name (the PyPI package called ``apex`` is an unrelated web toolkit).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from typing import Any

from lightning_utilities.core.imports import RequirementCache

APEX_HINT = (
    "Build NVIDIA Apex from source with its CUDA extensions: "
    "`pip install -v --no-build-isolation --config-settings '--build-option=--cuda_ext' "
    "git+https://github.com/NVIDIA/apex` (the PyPI package named `apex` is unrelated)."
)
APEX_MODULES = ("amp_C", "apex.multi_tensor_apply")
# Read from the installed metadata on first use; nothing is imported.
_MATPLOTLIB = RequirementCache("matplotlib")
# fp8 training (amp_plugin.fp8) is built and tested against this torchao release.
TORCHAO_REQUIREMENT = "torchao==0.18.0"
TORCHAO_HINT = 'pip install "amp_plugin[fp8]" (or `pip install torchao==0.18.0`; it leaves torch as it is).'
_TORCHAO = RequirementCache(TORCHAO_REQUIREMENT)  # metadata only: torchao is imported when used


@functools.cache
def apex_error() -> str | None:
    """Why the Apex ``amp_C`` kernels cannot be used, or ``None`` when they can.

    Example:
        >>> apex_error() is None or isinstance(apex_error(), str)
        True
    """
    for module in APEX_MODULES:
        try:
            found = bool(RequirementCache(module=module))
        except Exception as err:  # a broken CUDA build can raise more than ImportError while loading
            return f"{type(err).__name__}: {err}"
        if not found:
            return f"`{module}` does not import"
    return None


def apex_available() -> bool:
    """``True`` when ``amp_C`` and ``apex.multi_tensor_apply`` both import.

    Example:
        >>> apex_available() == (apex_error() is None)
        True
    """
    return apex_error() is None


def import_amp_c() -> tuple[Any, Any]:
    """Return ``(amp_C, multi_tensor_applier)``; raise ``ImportError`` with a hint when missing.

    Example:
        >>> try:
        ...     amp_c, applier = import_amp_c()
        ... except ImportError as err:
        ...     assert "HINT: Build NVIDIA Apex" in str(err)
    """
    reason = apex_error()
    if reason is not None:
        raise ImportError(f"NVIDIA Apex `amp_C` is not importable ({reason}). HINT: {APEX_HINT}")
    amp_c = importlib.import_module("amp_C")
    applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
    return amp_c, applier


def torchao_error() -> str | None:
    """Why torchao's float8 training cannot be used, or ``None`` when it can (asked once, then cached).

    Example:
        >>> torchao_error() is None or "torchao" in torchao_error()
        True
    """
    if "torchao" in sys.modules and sys.modules.get("torchao") is None:  # blocked: `import` would fail
        return "`torchao` does not import"
    version = package_version("torchao")
    if version is None:
        return "`torchao` is not installed"
    if not _TORCHAO:
        return f"torchao {version} is installed; amp_plugin's fp8 needs {TORCHAO_REQUIREMENT}"
    return None


def require_torchao(call: str) -> None:
    """Raise ``ImportError`` naming ``call`` and the install command when torchao's float8 is missing.

    Example:
        >>> try:
        ...     require_torchao("AMPPrecision(fp8='tensorwise')")
        ... except ImportError as err:
        ...     assert "HINT: pip install" in str(err)
    """
    reason = torchao_error()
    if reason is not None:
        raise ImportError(f"{call} needs torchao's float8 training ({reason}). HINT: {TORCHAO_HINT}")


def matplotlib_available() -> bool:
    """``True`` when ``import matplotlib`` would succeed, read from its installed metadata (not imported).

    Example:
        >>> isinstance(matplotlib_available(), bool)
        True
    """
    if "matplotlib" in sys.modules:  # imported already, or blocked (None): `import` would answer the same
        return sys.modules["matplotlib"] is not None
    return bool(_MATPLOTLIB)


@functools.cache
def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` from its metadata (nothing is imported), or ``None``.

    Example:
        >>> package_version("torch") is not None, package_version("no-such-distribution")
        (True, None)
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
