"""Tests for ``amp_plugin._imports``: the optional-dependency probes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from lightning_utilities.core.imports import RequirementCache

from amp_plugin import _imports
from tests.fakes import fake_apex, no_apex


def test_matplotlib_probe_answers_as_import_would(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _imports.matplotlib_available() is bool(RequirementCache("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert _imports.matplotlib_available() is False


def test_apex_probe_follows_amp_c() -> None:
    with no_apex():
        assert _imports.apex_error() == "`amp_C` does not import"
        with pytest.raises(ImportError, match=r"`amp_C` does not import.*HINT: Build NVIDIA Apex"):
            _imports.import_amp_c()
    with fake_apex() as fake:
        assert _imports.apex_available()
        assert _imports.import_amp_c() == (fake.amp_c, fake.applier)


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_probing_imports_nothing_until_asked() -> None:
    code = (
        "import sys, amp_plugin._imports; "
        "banned = ('amp_C', 'apex', 'matplotlib', 'lightning', 'torchao'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


def test_package_version_reads_metadata() -> None:
    import torch

    version = _imports.package_version("torch")
    assert version is not None and version.split("+")[0] == torch.__version__.split("+")[0]
    assert _imports.package_version("no-such-distribution-here") is None
