"""Run a worker in a few gloo processes and read back what each rank returned.

A worker is ``worker(rank) -> dict``: it runs inside a joined gloo group (file store, one
intra-op thread) and returns a JSON-serialisable result. The ranks leave the group together and
exit without the interpreter's shutdown.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Worker = Callable[[int], Any]


def run_ranks(worker: Worker, root: Path, world: int) -> list[Any]:
    """Spawn ``world`` processes of ``worker`` and return each rank's result, in rank order."""
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_rank_main, args=(worker, str(root), world), nprocs=world)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, worker: Worker, root: str, world: int) -> None:
    """One rank: join, run ``worker``, leave together, write its result, exit at once.

    The exit skips the interpreter's shutdown: freeing a distributed model or a process group
    there can abort the process ("terminate called without an active exception") or deadlock on
    the GIL in gloo's teardown, now and then; the result is on disk already, so nothing is lost.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        result = worker(rank)
    finally:
        leave_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def leave_group() -> None:
    """Barrier, then tear the group down: a rank leaving early can make gloo abort another at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def skip_teardown_at_exit() -> None:
    """At interpreter exit, flush and leave at once: call it last in a process whose work is done.

    A process that took part in a gloo group can abort while the interpreter frees it ("terminate
    called without an active exception"), now and then, even after :func:`leave_group`; a launcher
    then sees a signal where the work succeeded. Registered last, this exit handler runs first.
    """

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    atexit.register(leave)

