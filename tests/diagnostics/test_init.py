"""Tests for ``amp_plugin.diagnostics`` itself and the old ``amp_plugin.health`` path: what they re-export."""

from __future__ import annotations

import importlib

import pytest

from amp_plugin import diagnostics

HOMES = {
    "AutocastOps": "autocast_ops",
    "OpProbe": "autocast_ops",
    "format_autocast_ops": "autocast_ops",
    "probe_autocast_ops": "autocast_ops",
    "AuditReport": "audit",
    "Finding": "audit",
    "audit_model": "audit",
    "device_report": "device_report",
    "format_device_report": "device_report",
    "NonFiniteGradient": "nonfinite",
    "nonfinite_gradients": "nonfinite",
    "check_optimizer_setup": "optimizer_check",
    "NonFiniteRecord": "tracer",
    "NonFiniteTracer": "tracer",
}


@pytest.mark.parametrize(("name", "module"), HOMES.items())
def test_the_package_exports_each_name_from_its_public_module(name: str, module: str) -> None:
    home = importlib.import_module(f"amp_plugin.diagnostics.{module}")
    assert getattr(diagnostics, name) is getattr(home, name)
    assert name in home.__all__


def test_the_package_exports_exactly_these_names() -> None:
    assert sorted(diagnostics.__all__) == sorted(HOMES)


def test_amp_plugin_health_still_offers_every_name() -> None:
    from amp_plugin import health
    from amp_plugin.diagnostics import health as skip_health
    from amp_plugin.diagnostics import health_plot, health_state

    homes = (skip_health, health_plot, health_state)
    for name in health.__all__:
        assert any(getattr(m, name, None) is getattr(health, name) for m in homes), name
    assert {"SkipHealth", "ScaleRecord", "plot_history", "check_monitor_state", "SHOWN_FLAGS"} <= set(
        health.__all__
    )
