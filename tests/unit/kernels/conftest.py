"""Kernel test fixtures: ``fake`` (the Apex double on CPU), ``cuda_rules`` (CUDA's op rules on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes import FakeApex, fake_apex
from tests.fakes.cuda_rules import cuda_rules_on_cpu
from tests.unit.kernels._tensors import SMALL_CHUNK


@pytest.fixture
def fake() -> Iterator[FakeApex]:
    with fake_apex(chunk_size=SMALL_CHUNK) as installed:
        yield installed


@pytest.fixture
def cuda_rules() -> Iterator[None]:
    """CPU tensors meet CUDA's rules: no bf16 unscale op, a device factor rounded to a half dtype."""
    with cuda_rules_on_cpu():
        yield
