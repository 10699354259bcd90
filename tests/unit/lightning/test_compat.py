"""amp_plugin/lightning/_compat.py stays the one list of Lightning internals, each one pinned."""

from __future__ import annotations

import inspect
from pathlib import Path

from amp_plugin.lightning import _compat

PIN_TEST = Path(__file__).resolve().parents[2] / "integration" / "test_plugin_lightning.py"


def test_every_compat_function_is_exported_and_called_by_the_pin_test() -> None:
    defined = {
        n for n, f in vars(_compat).items() if inspect.isfunction(f) and f.__module__ == _compat.__name__
    }
    assert defined == set(_compat.__all__)
    pin_test = PIN_TEST.read_text()
    assert [n for n in _compat.__all__ if f"_compat.{n}(" not in pin_test] == []
