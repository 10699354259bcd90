"""Shared test set-up: the `cuda` and `apex` markers skip cleanly where the hardware is missing."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from amp_plugin import _imports


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    no_apex = pytest.mark.skip(reason=f"needs NVIDIA Apex amp_C ({_imports.apex_error()})")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "apex" in item.keywords and not (torch.cuda.is_available() and _imports.apex_available()):
            item.add_marker(no_apex)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_environment() -> Iterator[None]:
    """Undo what a test leaves in ``os.environ``.

    Lightning's launchers write MASTER_PORT (and the rank variables) into the parent process; a
    later spawn would reuse that port, sometimes before the last process group released it.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
