"""Shared test set-up: the `cuda` and `apex` markers skip cleanly; every test runs isolated (`_isolated`).

The ``device`` fixture runs a test on every device this machine has: ``"cpu"``, plus ``"cuda"``
where CUDA is available. Tests that take it build their tensors, models and oracles there.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from amp_plugin import _imports

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Subprocesses (examples, benchmarks) import ``amp_plugin`` from this checkout.

    Without this they import whatever the environment's editable install points to, which for a
    second worktree sharing one virtualenv is another checkout: its tests pass or fail on code
    that is not the code under test.
    """
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    _share_the_cores()


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker takes its share of the cores (unless OMP_NUM_THREADS says otherwise).

    torch starts one intra-op thread per core in every process: 14 workers on 16 cores run 224
    threads, and a thread waiting for its core holds up every op it is part of. The processes the
    tests start (examples, benchmarks, ranks) inherit the share through ``OMP_NUM_THREADS``. (The
    GPU machine's run, ``-n 14 --timeout 90`` on 16 cores, failed mostly the slowest tests: those
    that start processes, compile, or train for many steps.)
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    no_apex = pytest.mark.skip(reason=f"needs NVIDIA Apex amp_C ({_imports.apex_error()})")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "apex" in item.keywords and not (torch.cuda.is_available() and _imports.apex_available()):
            item.add_marker(no_apex)


def fork_unsafe() -> bool:
    """Whether this process may not fork ranks: CUDA is initialised here (Lightning then refuses to fork).

    An xdist worker on a GPU machine initialises CUDA in its first CUDA test, and the ``ddp_fork``
    tests it runs after that would fail by their order alone.
    """
    return torch.cuda.is_initialized()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A ``forks`` test in a process that cannot fork runs whole in a fresh interpreter instead."""
    if pyfuncitem.get_closest_marker("forks") is None or not fork_unsafe():
        return None
    run = subprocess.run(
        [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-p", "no:xdist", "-p", "no:cacheprovider"],
        cwd=pyfuncitem.config.rootpath,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0 or " passed" not in run.stdout:
        pytest.fail(
            f"{pyfuncitem.nodeid}, rerun in a fresh interpreter (CUDA is initialised in this one), "
            f"exited {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}",
            pytrace=False,
        )
    return True


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"``, and ``"cuda"`` where CUDA is available: the same assertions on each device.

    An oracle computed in the test runs on the same device, so it has that device's arithmetic.
    """
    return str(request.param)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    """Start every test from the same process-wide state and put that state back afterwards.

    Saved and restored: torch's intra-op thread count, default dtype, grad mode, CPU (and, once
    initialised, CUDA) RNG state, and ``os.environ``; a default process group the test left
    behind is destroyed. A test then starts from ``manual_seed(0)``.

    A test that leaves the thread count, the default dtype, grad mode or a process group changed fails at
    teardown (after the restore, so the tests after it still start clean): such a test makes
    later tests pass or fail by the order and the thread count they run with, which is how
    ``torch.set_num_threads(1)`` in one test once broke an accuracy bound in another. The RNG
    state and the environment are restored without complaint: every test draws random numbers,
    and Lightning's launchers write MASTER_PORT (and the rank variables) into the parent process,
    where a later spawn would reuse that port, sometimes before the last process group released it.
    """
    threads, dtype, grad = torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    environ = dict(os.environ)
    torch.manual_seed(0)
    _forget_said_once()
    yield
    leaked = [
        f"{name} was {before}, the test left it {after}"
        for name, before, after in (
            ("torch.get_num_threads()", threads, torch.get_num_threads()),
            ("torch.get_default_dtype()", dtype, torch.get_default_dtype()),
            ("torch.is_grad_enabled()", grad, torch.is_grad_enabled()),
            ("torch.distributed.is_initialized()", group, _group_initialised()),
        )
        if before != after
    ]
    if not group and _group_initialised():
        torch.distributed.destroy_process_group()  # in-process strategies (FSDP on one GPU) leave one
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    os.environ.clear()
    os.environ.update(environ)
    if leaked:
        pytest.fail(
            "global state changed and not restored: " + "; ".join(leaked) + ". HINT: restore it in "
            "the test (try/finally, a context manager or monkeypatch), or run the code in a subprocess.",
            pytrace=False,
        )


# A rank process still running this long after its test started is hung (the slowest multi-process
# test takes about a minute on 2 cores): it is killed, so that its test fails with the rank's exit
# and the run goes on, where a hung rank would stall the whole run until CI's own limit. A timer
# signal, not a thread: a thread alive at fork time makes Python 3.12 warn and forked ranks wary.
RANK_DEADLINE_S = 240


@pytest.fixture(autouse=True)
def _hung_ranks_killed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Kill the test's child processes (DDP ranks) if they outlive ``RANK_DEADLINE_S``."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def kill_ranks(signum: int, frame: Any) -> None:
        for child in multiprocessing.active_children():
            print(f"\n{request.node.nodeid}: process {child.pid} ({child.name}) still running after "
                  f"{RANK_DEADLINE_S} s: hung, killed", file=sys.stderr, flush=True)  # fmt: skip
            child.kill()

    previous = signal.signal(signal.SIGALRM, kill_ranks)
    signal.setitimer(signal.ITIMER_REAL, RANK_DEADLINE_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _one_thread_for_forked_ranks(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``forks`` test runs with one intra-op thread, so that its forked ranks inherit one.

    OpenMP is not fork-safe: a rank forked from a process whose OpenMP threads have run can wait
    forever at its first parallel region (seen in CI: a ``ddp_fork`` rank stuck in libgomp's team
    barrier inside an fp16 matmul). With one thread, torch runs every op inline. Defined after
    ``_isolated``, so the count is back before that fixture checks it.
    """
    if request.node.get_closest_marker("forks") is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _group_initialised() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _forget_said_once() -> None:
    # AMPPrecision says "this CPU emulates ..." once per process; each test is a process of its own.
    run = sys.modules.get("amp_plugin._run")
    if run is not None:
        run._SAID.clear()
