"""The ``fake`` fixture: the real ``ApexKernels`` on CPU, launching a pure-torch double of ``amp_C``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes import FakeApex, fake_apex
from tests.kernels._tensors import SMALL_CHUNK


@pytest.fixture
def fake() -> Iterator[FakeApex]:
    with fake_apex(chunk_size=SMALL_CHUNK) as installed:
        yield installed
