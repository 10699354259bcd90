"""The public surface: the names docs/api.md teaches, each importable from one path, and no others.

A module is public when no part of its dotted name starts with ``_``; its public names are its
``__all__``. Everything else may change without notice, so nothing in the guides may need it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import amp_plugin

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()

PUBLIC_MODULES = {
    "amp_plugin",
    "amp_plugin.accelerate",
    "amp_plugin.autocast",
    "amp_plugin.cli",
    "amp_plugin.consistency",
    "amp_plugin.diagnostics",
    "amp_plugin.lightning.fabric",
    "amp_plugin.fp32_policy",
    "amp_plugin.fp8",
    "amp_plugin.grad_accumulation",
    "amp_plugin.kernels",
    "amp_plugin.lightning",
    "amp_plugin.master_weights",
    "amp_plugin.numerics",
    "amp_plugin.precision",
    "amp_plugin.rounded_updates",
    "amp_plugin.spike",
}


def _public_modules() -> set[str]:
    names = {m.name for m in pkgutil.walk_packages(amp_plugin.__path__, "amp_plugin.")} | {"amp_plugin"}
    return {m for m in names if not any(part.startswith("_") for part in m.split("."))}


def test_the_public_modules_are_these() -> None:
    assert _public_modules() == PUBLIC_MODULES


def test_every_public_name_is_in_the_api_summary() -> None:
    missing = [
        f"{module}.{name}"
        for module in sorted(PUBLIC_MODULES)
        for name in importlib.import_module(module).__all__
        if not re.search(rf"\b{re.escape(name)}\b", API)
    ]
    assert not missing, missing


def test_each_public_object_has_one_public_path() -> None:
    paths: dict[int, list[str]] = {}
    for module in sorted(PUBLIC_MODULES):
        home = importlib.import_module(module)
        for name in home.__all__:
            value = getattr(home, name)
            if isinstance(value, (str, int, float, tuple, frozenset)):
                continue  # a constant's value may equal another's
            paths.setdefault(id(value), []).append(f"{module}.{name}")
    assert not [p for p in paths.values() if len(p) > 1]


def test_the_surface_is_small() -> None:
    total = sum(len(importlib.import_module(m).__all__) for m in PUBLIC_MODULES)
    assert total <= 55, f"{total} public names: each new one needs a guide that teaches it"


def test_dir_shows_the_lazy_names_without_importing_lightning() -> None:
    import subprocess
    import sys

    code = "import sys, amp_plugin; print('AMPPrecision' in dir(amp_plugin), 'lightning' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False"]
