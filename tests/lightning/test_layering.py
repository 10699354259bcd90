"""Only amp_plugin/lightning/ imports Lightning; the rest of the package is plain torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "amp_plugin"
LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch_lightning", "lightning_fabric")
# Outside amp_plugin/lightning/, only these may name amp_plugin.lightning: three re-export shims
# (two for the documented old paths, one for Fabric's plugin), and the package's lazy exports.
SHIMS = {"__init__.py", "plugin.py", "callbacks.py", "fabric.py"}


def _imported(source: str) -> list[str]:
    """Every absolute module name an import statement in ``source`` names."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _is_lightning(name: str) -> bool:
    return name.split(".")[0] in LIGHTNING_DISTRIBUTIONS


def _modules() -> list[Path]:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "lightning" / "plugin.py" in modules  # the walk sees the package
    return modules


@pytest.mark.parametrize(
    ("source", "hit"),
    [
        ("import lightning", True),
        ("import torch, lightning.pytorch as pl", True),
        ("from lightning.pytorch.utilities import rank_zero_warn", True),
        ("def f():\n    from pytorch_lightning import Trainer", True),
        ("from amp_plugin.lightning import AMPPrecision", False),
        ("import lightning_utilities", False),
        ("from . import lightning", False),
    ],
)
def test_the_check_sees_every_form_of_import(source: str, hit: bool) -> None:
    assert any(_is_lightning(n) for n in _imported(source)) is hit


def test_only_the_lightning_package_imports_lightning() -> None:
    outside = [p for p in _modules() if "lightning" not in p.relative_to(PACKAGE).parts[:-1]]
    offenders = {
        str(p.relative_to(PACKAGE)): names
        for p in outside
        if (names := [n for n in _imported(p.read_text()) if _is_lightning(n)])
    }
    assert offenders == {}
    inside = [
        p.name for p in _modules() if p not in outside and any(map(_is_lightning, _imported(p.read_text())))
    ]
    assert "plugin.py" in inside and "monitor.py" in inside  # the check reads what it should


def test_only_the_shims_import_the_lightning_package() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if p.parent == PACKAGE
        and p.name not in SHIMS
        and any(n.startswith("amp_plugin.lightning") for n in _imported(p.read_text()))
    ]
    nested = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if p.parent != PACKAGE
        and "lightning" not in p.relative_to(PACKAGE).parts[:-1]
        and any(n.startswith("amp_plugin.lightning") for n in _imported(p.read_text()))
    ]
    assert offenders + nested == []
