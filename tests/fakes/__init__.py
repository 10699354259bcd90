"""Test doubles. :func:`fake_apex` puts a pure-torch ``amp_C`` where ``amp_plugin`` looks for Apex.

Use it from a fixture, so that the real :class:`~amp_plugin.kernels._apex.ApexKernels` runs on CPU::

    @pytest.fixture
    def fake() -> Iterator[FakeApex]:
        with fake_apex() as installed:
            yield installed
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
from lightning_utilities.core.imports import module_available, package_available

from amp_plugin import _imports
from amp_plugin import kernels as kernels_pkg
from tests.fakes import fake_amp_c
from tests.fakes.fake_amp_c import CHUNK_SIZE, MultiTensorApply

__all__ = ["FakeApex", "fake_apex", "no_apex"]

_OPS = (
    fake_amp_c.multi_tensor_scale,
    fake_amp_c.multi_tensor_l2norm,
    fake_amp_c.multi_tensor_l2norm_scale,
    fake_amp_c.update_scale_hysteresis,
)


@dataclass(frozen=True)
class FakeApex:
    """The installed double: the ``amp_C`` module and the launcher that logs each launch."""

    amp_c: ModuleType
    applier: MultiTensorApply

    @property
    def calls(self) -> list[str]:
        """Names of the ``amp_C`` ops launched so far, in order."""
        return self.applier.calls


@contextlib.contextmanager
def fake_apex(*, chunk_size: int = CHUNK_SIZE, cpu: bool = True) -> Iterator[FakeApex]:
    """Install the double as ``amp_C``, ``apex`` and ``apex.multi_tensor_apply`` for the duration.

    Args:
        chunk_size: what the launcher passes to each op; small values exercise several chunks.
        cpu: also launch on CPU tensors (``ApexKernels`` otherwise sends them to the torch backend).
    """
    amp_c = ModuleType("amp_C")
    for op in _OPS:
        setattr(amp_c, op.__name__, op)
    applier = MultiTensorApply(chunk_size)
    launcher = ModuleType("apex.multi_tensor_apply")
    launcher.multi_tensor_applier = applier  # type: ignore[attr-defined]
    launcher.MultiTensorApply = MultiTensorApply  # type: ignore[attr-defined]
    apex = ModuleType("apex")
    apex.__path__ = []
    apex.multi_tensor_apply = launcher  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as patch:
        for name, module in (("amp_C", amp_c), ("apex", apex), ("apex.multi_tensor_apply", launcher)):
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # what find_spec reports of it
            patch.setitem(sys.modules, name, module)
        if cpu:
            from amp_plugin.kernels._apex import ApexKernels

            patch.setattr(ApexKernels, "device_types", ApexKernels.device_types | {"cpu"})
        with _fresh_probes():
            yield FakeApex(amp_c, applier)


@contextlib.contextmanager
def no_apex() -> Iterator[None]:
    """Make ``amp_C`` unimportable for the duration, even where Apex is installed."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("amp_C", "apex", "apex.multi_tensor_apply"):
            patch.setitem(sys.modules, name, None)  # None in sys.modules makes `import` raise ImportError
        with _fresh_probes():
            yield


@contextlib.contextmanager
def _fresh_probes() -> Iterator[None]:
    """Forget the cached Apex probe and backend on entry and on exit, so neither outlives the patch.

    ``RequirementCache`` answers through lightning_utilities' process-wide caches of
    ``module_available``/``package_available``, which are forgotten too.
    """
    caches = (_imports.apex_error, kernels_pkg._apex_backend, module_available, package_available)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()
