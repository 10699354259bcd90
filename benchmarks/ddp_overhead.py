"""What ``sync_found_inf`` costs under DDP: steps/s with the inf flag all-reduced vs not.

Two CPU processes (gloo on 127.0.0.1, one thread each) train the same small transformer
language model (a stand-in for the quickstart model) under DDP with a ``LossScaler``. Each
timed sample runs ``--steps`` training steps with one of two scalers on the same model,
``sync_found_inf=False`` or ``True``; the samples interleave (``_common.measure``), and a
sample counts the slower rank. Each round times both modes back to back, so the ratio
reported is the median over rounds of the per-round ratio "on / off": load from other
processes that drifts over seconds cancels out of it. The script also counts the collectives per step: DDP's
gradient buckets (read from DDP's logging data) and the scaler's own all-reduces (counted by
wrapping ``torch.distributed.all_reduce`` in this script during a separate, untimed phase).

    python benchmarks/ddp_overhead.py                 # table
    python benchmarks/ddp_overhead.py --json out.json # table + JSON
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import (
    Case,
    environment,
    exit_worker,
    format_table,
    init_gloo,
    leave_gloo,
    measure,
    median_ms,
    write_json,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_plugin import LossScaler
from amp_plugin._distributed import all_reduce_found_inf
from amp_plugin.consistency import check_consistency

WORLD = 2
MODES = {"sync off": False, "sync on": True}
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TinyLM(nn.Module):
    """Embedding, a pre-norm transformer encoder and a tied-free vocabulary head."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, 4, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]]))


def _train_steps(
    ddp: nn.Module, opt: torch.optim.Optimizer, scaler: LossScaler, batches: list[torch.Tensor], dtype: Any
) -> None:
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = ddp(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _count_scaler_collectives(run: Any) -> tuple[int, list[int]]:
    """Python-level all-reduces during ``run()`` and their sizes in bytes (DDP's run in C++)."""
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
        run()
    sizes = [call.args[0].numel() * call.args[0].element_size() for call in spy.call_args_list]
    return spy.call_count, sizes


def _time_flag_all_reduce(repeats: int = 500) -> float:
    """Microseconds per all-reduce of the 4-byte inf flag alone: the floor of the overhead."""
    flag = torch.zeros((), dtype=torch.float32)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        all_reduce_found_inf(flag)
    return (time.perf_counter() - start) / repeats * 1e6


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_gloo(rank, port, WORLD)
    try:
        torch.manual_seed(0)
        model = TinyLM(args.vocab, args.d_model, args.layers, args.seq)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scalers = {name: LossScaler(init_scale=2.0**12, sync_found_inf=sync) for name, sync in MODES.items()}
        gen = torch.Generator().manual_seed(rank)
        batches = [
            torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)
        ]
        dtype = AUTOCAST[args.autocast]
        cases = [
            Case(name, lambda s=scaler: _train_steps(ddp, opt, s, batches, dtype), setup=dist.barrier)
            for name, scaler in scalers.items()
        ]
        samples = measure(cases, device="cpu", warmup=args.warmup, repeats=args.repeats)
        counts = {
            name: _count_scaler_collectives(lambda s=scaler: _train_steps(ddp, opt, s, batches[:3], dtype))
            for name, scaler in scalers.items()
        }
        flag_us = _time_flag_all_reduce()
        everyone: list[Any] = [None] * WORLD
        dist.all_gather_object(everyone, samples)
        check_consistency(scalers["sync on"], ddp)  # the replicas are still bit-identical
        if rank == 0:
            slowest = {
                name: [max(s) for s in zip(*(r[name] for r in everyone), strict=True)] for name in MODES
            }
            buckets = [int(b) for b in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(",") if b]
            result = {
                "params": sum(p.numel() for p in model.parameters()),
                "samples_ms": slowest,
                "scaler_collectives": {
                    name: {"count": c / 3, "bytes": sorted(set(sizes))} for name, (c, sizes) in counts.items()
                },
                "ddp_buckets_bytes": buckets,
                "flag_all_reduce_us": flag_us,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        leave_gloo()
    exit_worker()  # only after a clean run: an exception above still reaches mp.spawn


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of the TinyLM benchmarks run in gloo processes (this one and fsdp_overhead)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=4, help="training steps per timed sample")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed samples (rounds) per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 samples of a small model")
    return parser


def parse_model_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.d_model, args.layers, args.seq = 3, 1, 64, 1, 16
    return args


def run_workers(worker: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``worker(rank, port, args, out)`` in WORLD processes; rank 0 writes the JSON read back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "result.json"))
        mp.spawn(worker, args=(_free_port(), args, out), nprocs=WORLD, join=True)
        return dict(json.loads(Path(out).read_text()))


def main() -> None:
    parser = model_arguments(__doc__.splitlines()[0], repeats=20)
    parser.add_argument("--autocast", choices=sorted(AUTOCAST), default="none", help="CPU autocast dtype")
    args = parse_model_arguments(parser)
    result = run_workers(_worker, args)

    per_step = {name: median_ms(ms) / args.steps for name, ms in result["samples_ms"].items()}
    base = per_step["sync off"]
    spread = {name: statistics.pstdev(ms) / statistics.mean(ms) for name, ms in result["samples_ms"].items()}
    paired = sorted(
        on / off
        for on, off in zip(result["samples_ms"]["sync on"], result["samples_ms"]["sync off"], strict=True)
    )
    ratio = statistics.median(paired)
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [ratio, ratio, ratio]
    rows = [
        [name, f"{1e3 / ms:.2f}", f"{ms:.2f}", "1.000" if name == "sync off" else f"{ratio:.3f}",
         f"{100 * spread[name]:.1f}%"]
        for name, ms in per_step.items()
    ]  # fmt: skip
    collectives = result["scaler_collectives"]
    buckets = result["ddp_buckets_bytes"]
    comm_rows = [
        ["DDP gradient buckets (both modes)", str(len(buckets)), " + ".join(f"{b:,}" for b in buckets)],
        *[
            [f"scaler found_inf, {name}", f"{c['count']:g}", ", ".join(f"{b:,}" for b in c["bytes"]) or "-"]
            for name, c in collectives.items()
        ],
    ]
    print(
        f"sync_found_inf overhead under DDP: {WORLD} gloo processes on CPU, 1 thread each, "
        f"TinyLM {result['params'] / 1e6:.2f}M params, batch {args.batch}x{args.seq} per rank, "
        f"autocast={args.autocast}, AdamW; median of {args.repeats} interleaved samples of {args.steps} steps"
    )
    print(format_table(["mode", "steps/s", "ms/step", "vs off (paired)", "spread"], rows))
    print(f"per-round ratio on/off: median {ratio:.3f}, quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f}")
    print()
    print(format_table(["collectives per step", "count", "bytes each"], comm_rows))
    flag_us = result["flag_all_reduce_us"]
    print(
        f"\nthe found_inf all-reduce alone: {flag_us:.0f} us = {100 * flag_us / 1e3 / base:.2f}% of a "
        "sync-off step (the expected overhead; the end-to-end ratio above also carries timing noise)"
    )
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "ddp_overhead",
                "environment": environment("cpu"),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "world_size": WORLD,
                "params": result["params"],
                "ms_per_step": per_step,
                "ratio_on_vs_off": ratio,
                "ratio_quartiles": [quartiles[0], quartiles[2]],
                "flag_all_reduce_us": flag_us,
                "samples_ms": result["samples_ms"],
                "collectives_per_step": {"ddp_buckets_bytes": buckets, "scaler": collectives},
            },
        )


if __name__ == "__main__":
    main()
