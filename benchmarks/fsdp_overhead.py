"""What agreeing on the inf flag costs under FSDP2 (torch's ``fully_shard``): steps/s with it on vs off.

Two CPU processes (gloo on 127.0.0.1, one thread each) train the small transformer language
model of ``ddp_overhead.py`` with every encoder layer and the root ``fully_shard``-ed, so the
parameters and gradients are ``DTensor`` shards. Each timed sample runs ``--steps`` training
steps with one of three scalers on the same model: ``LossScaler(sync_found_inf=False)``
(no agreement: the baseline), ``LossScaler(sync_found_inf=True)`` (one all-reduce of the
4-byte flag per step) and torch's ``GradScaler`` (whose inf check on DTensors runs through
DTensor's dispatch, which reduces the flag inside the op, for each ``(device, dtype)`` group).
The samples interleave (``_common.measure``), a sample counts the slower rank, and the ratio
reported is the median over rounds of the per-round ratio against the baseline. The script
also counts the scaler's ``torch.distributed.all_reduce`` calls per step (untimed phase) and
times the flag all-reduce alone.

    python benchmarks/fsdp_overhead.py                 # table
    python benchmarks/fsdp_overhead.py --json out.json # table + JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
from ddp_overhead import (
    TinyLM,
    _count_scaler_collectives,
    _time_flag_all_reduce,
    model_arguments,
    parse_model_arguments,
    run_workers,
)  # fmt: skip
from torch import nn

from amp_plugin import LossScaler

WORLD = 2
BASE = "LossScaler, sync off"


def _scalers() -> dict[str, Any]:
    return {
        BASE: LossScaler(init_scale=2.0**12, sync_found_inf=False),
        "LossScaler, sync on": LossScaler(init_scale=2.0**12, sync_found_inf=True),
        "torch GradScaler": torch.amp.GradScaler("cpu", init_scale=2.0**12),
    }


def _train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, batches: list[torch.Tensor]
) -> None:
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, port, WORLD)
    try:
        torch.manual_seed(0)
        model = TinyLM(args.vocab, args.d_model, args.layers, args.seq)
        mesh = init_device_mesh("cpu", (WORLD,))  # the default mesh is CUDA's where CUDA is present
        for layer in model.encoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scalers = _scalers()
        gen = torch.Generator().manual_seed(rank)
        batches = [
            torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)
        ]
        cases = [
            Case(name, lambda s=scaler: _train_steps(model, opt, s, batches), setup=dist.barrier)
            for name, scaler in scalers.items()
        ]
        samples = measure(cases, device="cpu", warmup=args.warmup, repeats=args.repeats)
        counts = {
            name: _count_scaler_collectives(lambda s=scaler: _train_steps(model, opt, s, batches[:3]))
            for name, scaler in scalers.items()
        }
        flag_us = _time_flag_all_reduce()
        everyone: list[Any] = [None] * WORLD
        dist.all_gather_object(everyone, samples)
        if rank == 0:
            slowest = {
                name: [max(s) for s in zip(*(r[name] for r in everyone), strict=True)] for name in scalers
            }
            result = {
                "params": sum(p.numel() for p in model.parameters()),  # DTensor numel: the whole model
                "samples_ms": slowest,
                "scaler_all_reduces": {name: c / 3 for name, (c, _) in counts.items()},
                "flag_all_reduce_us": flag_us,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        leave_gloo()
    exit_worker()  # only after a clean run: an exception above still reaches mp.spawn


def main() -> None:
    args = parse_model_arguments(model_arguments(__doc__.splitlines()[0], repeats=15))
    result = run_workers(_worker, args)

    samples = result["samples_ms"]
    per_step = {name: median_ms(ms) / args.steps for name, ms in samples.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(ms, samples[BASE], strict=True))
        for name, ms in samples.items()
    }
    counts = result["scaler_all_reduces"]
    rows = [
        [name, f"{1e3 / ms:.2f}", f"{ms:.2f}", f"{ratios[name]:.3f}", f"{counts[name]:g}"]
        for name, ms in per_step.items()
    ]
    print(
        f"inf-flag agreement under FSDP2 (fully_shard): {WORLD} gloo processes on CPU, 1 thread each, "
        f"TinyLM {result['params'] / 1e6:.2f}M params, batch {args.batch}x{args.seq} per rank, AdamW; "
        f"median of {args.repeats} interleaved samples of {args.steps} steps"
    )
    headers = ["scaler", "steps/s", "ms/step", "vs sync off (paired)", "scaler all_reduce/step"]
    print(format_table(headers, rows))
    flag_us = result["flag_all_reduce_us"]
    print(
        f"\nthe found_inf all-reduce alone: {flag_us:.0f} us = "
        f"{100 * flag_us / 1e3 / per_step[BASE]:.2f}% of a sync-off step (torch GradScaler's "
        "reductions run inside DTensor's dispatch, not counted above)"
    )
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "fsdp_overhead",
                "environment": environment("cpu"),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "world_size": WORLD,
                "params": result["params"],
                "ms_per_step": per_step,
                "ratio_vs_sync_off": ratios,
                "scaler_all_reduces_per_step": result["scaler_all_reduces"],
                "flag_all_reduce_us": flag_us,
                "samples_ms": samples,
            },
        )


if __name__ == "__main__":
    main()
