"""Tests for ``amp_plugin.diagnostics`` itself: what the package exports."""

from __future__ import annotations

import importlib

import pytest

from amp_plugin import diagnostics

HOMES = {
    "format_autocast_ops": "autocast_ops",
    "probe_autocast_ops": "autocast_ops",
    "audit_model": "audit",
    "device_report": "device_report",
    "format_device_report": "device_report",
    "fp8_report": "fp8_report",
    "nonfinite_gradients": "nonfinite",
    "check_optimizer_setup": "optimizer_check",
    "NonFiniteTracer": "tracer",
}


@pytest.mark.parametrize(("name", "module"), HOMES.items())
def test_the_package_is_the_one_public_path_of_each_name(name: str, module: str) -> None:
    home = importlib.import_module(f"amp_plugin.diagnostics._{module}")  # private: one path per name
    assert getattr(diagnostics, name) is getattr(home, name)
    assert name in home.__all__


def test_the_package_exports_exactly_these_names() -> None:
    assert sorted(diagnostics.__all__) == sorted(HOMES)

