"""Helpers shared by the benchmark scripts: device choice, timing, tables, JSON.

Timing protocol: every case is timed in rounds that interleave all cases (``round_order``: the
order rotates, and runs backwards every other round), after warm-up rounds that are thrown away; a
median of its samples. Interleaving means a burst of load from another process on the
machine hits every case alike instead of one case's block, so ratios stay meaningful.
``setup``/``teardown`` run outside the timed region, and on CUDA the device is
synchronised on both sides of it, so a sample covers exactly the queued work of ``run``.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

T = TypeVar("T")

__all__ = [
    "Case",
    "default_device",
    "environment",
    "format_table",
    "measure",
    "median_ms",
    "round_order",
    "synchronize",
    "write_json",
]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Case:
    """One timed operation: ``setup()`` and ``teardown()`` run untimed around ``run()``."""

    name: str
    run: Callable[[], object]
    setup: Callable[[], object] = _nothing
    teardown: Callable[[], object] = _nothing


def default_device() -> str:
    """``"cuda"`` when a CUDA device is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def round_order(cases: Sequence[T], round_index: int) -> list[T]:
    """The cases' order in round ``round_index``: rotated by ``round_index // 2``, reversed in odd rounds.

    Every two rounds run each pair of cases once in each order, so a drift in time (a machine that
    warms up, a process that slows down fit after fit) cannot favour the case that runs first,
    as plain rotation does with fewer rounds than cases.

    Example:
        >>> [round_order("abc", r) for r in range(4)]
        [['a', 'b', 'c'], ['c', 'b', 'a'], ['b', 'c', 'a'], ['a', 'c', 'b']]
    """
    shift = (round_index // 2) % len(cases) if cases else 0
    order = [*cases[shift:], *cases[:shift]]
    return order[::-1] if round_index % 2 else order


def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work; a no-op on CPU, where every op has finished on return."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    cases: Sequence[Case], *, device: torch.device | str, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Time every case ``repeats`` times (after ``warmup`` untimed rounds), interleaved.

    Returns:
        The samples of each case in milliseconds, keyed by ``Case.name``, in timing order.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    samples: dict[str, list[float]] = {case.name: [] for case in cases}
    # A collection pause inside a timed region would be charged to whichever case it hit.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for round_index in range(warmup + repeats):
            for case in round_order(cases, round_index):
                case.setup()
                synchronize(device)
                start = time.perf_counter()
                case.run()
                synchronize(device)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                case.teardown()
                if round_index >= warmup:
                    samples[case.name].append(elapsed_ms)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def median_ms(samples: Sequence[float]) -> float:
    """The median of a case's samples (robust to the odd preempted repeat)."""
    return float(statistics.median(samples))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned.

    A row that is empty prints as a separator line.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(cells)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(headers), rule]
    out += [line(row) if row else rule for row in rows]
    return "\n".join(out)


def environment(device: torch.device | str) -> dict[str, Any]:
    """Where the numbers come from: host, device, library versions and the date."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.type,
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Other processes on a small machine distort timings; this says how busy it was.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_name() -> str:
    # platform.processor() is often empty or just "x86_64" on Linux; cpuinfo has the model.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def init_gloo(rank: int, port: int, world: int) -> None:
    """Join a gloo process group of ``world`` CPU processes on 127.0.0.1 (one torch thread each)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip


def exit_worker() -> None:
    """End a worker process at once, after its result is written and it has left the group.

    Skips the interpreter's shutdown, where freeing what still holds a gloo group can abort the
    process ("terminate called without an active exception") now and then.
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def leave_gloo() -> None:
    """Leave the process group together: a rank that tears gloo down while another still talks
    to it can abort ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by path: the examples are scripts, not a package."""
    if str(EXAMPLES) not in sys.path:  # the examples import each other's helpers by module name
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLES / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
