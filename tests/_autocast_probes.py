"""Probes shared by the autocast and fp32-policy tests: a thread's autocast state, a recording module."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def cpu_state() -> tuple[bool, torch.dtype, bool]:
    """The calling thread's CPU autocast flag and dtype, and the cache flag."""
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


def in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a fresh ``threading.Thread``; return its result or re-raise its error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class Recorder(nn.Module):
    """A Linear that records, per call, the thread, the CPU autocast state and the input dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append({"state": cpu_state(), "dtype": x.dtype, "thread": threading.get_ident()})
        return self.linear(x)
