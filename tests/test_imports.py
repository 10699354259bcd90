"""Tests for ``amp_plugin._imports``: the optional-dependency probes."""

from __future__ import annotations

import sys

import pytest

from amp_plugin import _imports


def test_matplotlib_probe_answers_as_import_would(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _imports.matplotlib_available() is _imports._module_found("matplotlib")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert _imports.matplotlib_available() is False


def test_package_version_reads_metadata() -> None:
    import torch

    version = _imports.package_version("torch")
    assert version is not None and version.split("+")[0] == torch.__version__.split("+")[0]
    assert _imports.package_version("no-such-distribution-here") is None
