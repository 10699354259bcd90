"""Run a worker in a few gloo processes and read back what each rank wrote.

A worker is ``worker(rank, store, out_dir)``: it joins the group through the file ``store``
(``init_method=f"file://{store}"``) and writes ``rank<N>.json`` into ``out_dir``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(worker: Callable[[int, str, str], None], root: Path, world: int) -> list[dict[str, Any]]:
    """Spawn ``world`` processes of ``worker`` and return each rank's JSON result, rank order."""
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(run_then_exit, args=(worker, str(root / "store"), str(root)), nprocs=world)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]


def run_then_exit(rank: int, worker: Callable[[int, str, str], None], store: str, out: str) -> None:
    """Run ``worker``, then leave the process at once: no interpreter shutdown, no gloo destructors.

    Freeing a distributed model or a process group at exit can abort the process ("terminate called
    without an active exception") or deadlock on the GIL in gloo's teardown, now and then; what the
    worker wrote is on disk already, so nothing is lost by skipping it.
    """
    worker(rank, store, out)
    os._exit(0)


def leave_group() -> None:
    """Barrier, then tear the group down: a rank leaving early can make gloo abort another at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
