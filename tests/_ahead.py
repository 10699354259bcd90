"""Subprocess runs started ahead of the tests that read them, two at a time.

The example and benchmark runs each pin one OpenMP thread, so on a 2-core machine two of them
overlap instead of queueing behind each other. The first test that needs a run starts every run
the session's selected tests will need (in their order); each test then waits for its own. A run
is made once per session, whoever asks for it first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import pytest

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class RunsAhead(Generic[K, R]):
    """``run(key)`` for each key, in background threads, ``workers`` at a time, once per key."""

    def __init__(self, run: Callable[[K], R], workers: int = 2) -> None:
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=workers)  # its threads start with the first run
        self._futures: dict[K, Future[R]] = {}

    def start(self, keys: Iterable[K]) -> None:
        """Queue the runs of ``keys`` not started yet, in that order."""
        for key in keys:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._run, key)

    def result(self, key: K) -> R:
        """``key``'s run, started now if nobody started it yet."""
        self.start([key])
        return self._futures[key].result()


def selected_tests(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The session's selected test functions, in run order (doctests and other items left out)."""
    return [item for item in request.session.items if isinstance(item, pytest.Function)]
