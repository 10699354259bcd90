"""Bytes per parameter, peak memory and steps/s for the half-precision-weight ladder.

One small transformer language model (embedding, ``--layers`` pre-norm encoder layers,
tied output head) trains with AdamW in each configuration:

  fp32           fp32 weights, no autocast
  O1 (autocast)  fp32 weights, bf16 autocast (``AMPPrecision("bf16-mixed")``)
  O2 (masters)   bf16 weights, fp32 norms, fp32 master weights (``master_weights=True``)
  O2 remainder   the same masters held as bf16 weights plus int16 remainders (``master_weights="remainder"``)
  bf16 nearest   bf16 weights, grads and AdamW state, the optimizer's own rounding ("bf16-true")
  bf16 stochastic  the same with stochastically rounded updates (``rounding="stochastic"``)
  bf16 kahan     the same with a bf16 Kahan compensation buffer (``rounding="kahan"``)

The loop is plain torch with amp_plugin's own pieces (``cast_model``, ``MasterWeights``,
``RoundedUpdates``), the ones ``AMPPrecision`` drives under Lightning.

**Bytes per parameter** sums the storage of every tensor that outlives a step, at the moment
the optimizer steps: weights, gradients, optimizer state, master copies and their gradients,
compensation buffers, remainders; each storage counted once, divided by the model's parameter count.
It is counted as ``optimizer.step`` is called (``B/param``, broken down by kind in ``at the call``)
and again once the optimizer's step pre-hooks have run (``in step``): the remainder masters'
fp32 values exist only inside the step, where they replace the remainders, and the stochastic
and Kahan roundings step fp32 copies there (counted as ``masters``: what the param groups hold).
``after`` counts once the step has returned: what the next forward pass holds until ``zero_grad``
(the remainder masters' gradients are bf16 again there).
**Peak** is the process's peak resident memory above its resident size before the model was
built, measured in a fresh subprocess per configuration (activations and temporaries
included; the allocator and Python add noise of a few MiB). **steps/s** are timed in this
process, all configurations interleaved (see ``_common.measure``), with pinned threads.

Targets: bf16 stochastic <= 8.5 B/param; O2 >= 0.95x O1's steps/s (CPU bf16); O2 remainder
<= 14 B per bf16 parameter (bf16 weight 2, bf16 grad 2, remainder 2, AdamW state 8; the fp32 norm
layers hold 16, as under O2, so the row's target is a hundredth above 14); O2 remainder >= 1.0x
O2's steps/s. Inside the step the fp32 masters (4) and their fp32 gradients (4) replace the
remainders and the bf16 gradients: 18, what O2 holds throughout.

    python benchmarks/memory.py                   # table
    python benchmarks/memory.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import Case, environment, format_table, measure, median_ms, write_json
from torch import Tensor, nn

from amp_plugin.master_weights import MasterWeights, cast_model
from amp_plugin.rounded_updates import RoundedUpdates

CONFIGS = (
    "fp32",
    "O1 (autocast)",
    "O2 (masters)",
    "O2 remainder",
    "bf16 nearest",
    "bf16 stochastic",
    "bf16 kahan",
)
TARGET_SR_BYTES = 8.5
TARGET_O2_VS_O1 = 0.95
TARGET_REMAINDER_BYTES = 14.0  # per bf16 parameter; the fp32 norm layers hold 16 (no masters), as under O2


@dataclass(frozen=True)
class Size:
    vocab: int
    d_model: int
    layers: int
    batch: int
    seq: int


FULL = Size(vocab=2048, d_model=128, layers=2, batch=8, seq=32)  # CPUs without AVX512-BF16/AMX emulate bf16
QUICK = Size(vocab=512, d_model=64, layers=2, batch=4, seq=16)


class LanguageModel(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.d_model)
        layer = nn.TransformerEncoderLayer(
            size.d_model, nhead=4, dim_feedforward=4 * size.d_model, dropout=0.0, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models usually are

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.encoder(self.embed(tokens))))


@dataclass
class Run:
    """One configuration, built and ready to step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool
    masters: MasterWeights | None
    tokens: Tensor

    def step(self) -> None:
        self.optimizer.zero_grad()
        context = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with context:
            logits = self.model(self.tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        if self.masters is not None:
            self.masters.grads_to_master(defer=True)  # as AMPPrecision does (only remainders defer)
        self.optimizer.step()


def build(config: str, size: Size) -> Run:
    torch.manual_seed(0)
    model = LanguageModel(size)
    tokens = torch.randint(
        0, size.vocab, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    masters = None
    if config == "O2 (masters)":
        masters = cast_model(model, torch.bfloat16)
    elif config == "O2 remainder":
        masters = cast_model(model, torch.bfloat16, master_weights="remainder")
    elif config.startswith("bf16"):
        cast_model(model, torch.bfloat16, keep_fp32=(), master_weights=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if masters is not None:
        masters.attach(optimizer)
    if config in ("bf16 stochastic", "bf16 kahan"):
        RoundedUpdates(optimizer, config.split()[1])  # type: ignore[arg-type]
    return Run(model, optimizer, config != "fp32", masters, tokens)


CATEGORIES = ("weights", "masters", "grads", "state", "remainders")


def _tensors(run: Run) -> Iterator[tuple[str, Tensor]]:
    """Every tensor that outlives a step, with its category (a storage counts for its first one)."""
    for p in run.model.parameters():
        yield "weights", p
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            yield "masters", p  # a model parameter here is counted as a weight already
    for p in run.model.parameters():
        if p.grad is not None:
            yield "grads", p.grad
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield "grads", p.grad
    for state in run.optimizer.state.values():
        yield from (("state", v) for v in state.values() if isinstance(v, Tensor))
    if run.masters is not None:
        yield from (("remainders", r) for r in run.masters.remainders())


def persistent_bytes(run: Run) -> dict[str, int]:
    """Storage bytes of the tensors alive now, by category, each storage once."""
    seen: dict[int, str] = {}
    by = dict.fromkeys(CATEGORIES, 0)
    for category, t in _tensors(run):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = category
            by[category] += storage.nbytes()
    return by


def bytes_per_param(config: str, size: Size) -> dict[str, dict[str, float]]:
    """Bytes per parameter by category, as ``optimizer.step`` is called and once its pre-hooks ran.

    The second count is taken by a step pre-hook registered after the masters' own (hooks run in
    the order they were registered): the remainder masters' fp32 values exist from there on.
    """
    run = build(config, size)
    run.step()  # the optimizer state exists from the first step on
    measured: dict[str, dict[str, int]] = {}
    original = run.optimizer.step

    def step_and_measure(*args: Any, **kwargs: Any) -> Any:
        measured["at_call"] = persistent_bytes(run)  # grads, state and masters all alive here
        result = original(*args, **kwargs)
        measured["after_step"] = persistent_bytes(run)  # what the next forward starts with (until zero_grad)
        return result

    def in_step(*_: Any) -> None:
        measured["in_step"] = persistent_bytes(run)

    handle = run.optimizer.register_step_pre_hook(in_step)
    run.optimizer.step = step_and_measure  # type: ignore[method-assign]
    run.step()
    handle.remove()
    n = sum(p.numel() for p in run.model.parameters())
    return {when: {k: v / n for k, v in by.items()} for when, by in measured.items()}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_growth_child(config: str, size: Size, steps: int) -> dict[str, float]:
    """In a fresh process: peak resident memory growth while building and training ``config``."""
    torch.set_num_threads(1)
    before = _rss_bytes()
    run = build(config, size)
    for _ in range(steps):
        run.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    n = sum(p.numel() for p in run.model.parameters())
    return {"peak_mib": (peak - before) / 2**20, "peak_bytes_per_param": (peak - before) / n}


def peak_growth(config: str, quick: bool, steps: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", config, *(["--quick"] if quick else []), "--steps", str(steps)],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few repeats (smoke runs)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the timing (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps for the peak measurement")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.child:
        print(json.dumps(peak_growth_child(args.child, size, args.steps)))
        return 0
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 7)
    runs = {config: build(config, size) for config in CONFIGS}
    params = sum(p.numel() for p in runs["fp32"].model.parameters())
    cases = [Case(config, runs[config].step) for config in CONFIGS]
    samples = measure(cases, device="cpu", warmup=1, repeats=repeats)
    # One fresh process per configuration, as many at a time as there are cores (each peak is its own).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        peaks = {c: pool.submit(peak_growth, c, args.quick, args.steps) for c in CONFIGS}
    rows, results = [], []
    for config in CONFIGS:
        ms = median_ms(samples[config])
        counts = bytes_per_param(config, size)
        result = {
            "config": config,
            "bytes_per_param": sum(counts["at_call"].values()),
            "in_step_bytes_per_param": sum(counts["in_step"].values()),
            "after_step_bytes_per_param": sum(counts["after_step"].values()),
            "breakdown": counts,
            **peaks[config].result(),
            "step_ms": ms,
            "steps_per_s": 1e3 / ms,
        }
        results.append(result)
        rows.append([config, f"{result['bytes_per_param']:.2f}", f"{result['in_step_bytes_per_param']:.2f}",
                     f"{result['after_step_bytes_per_param']:.2f}", _breakdown(counts["at_call"]),
                     f"{result['peak_mib']:.1f}", f"{ms:.1f}",
                     f"{result['steps_per_s']:.2f}"])  # fmt: skip
    by = {r["config"]: r for r in results}
    model = runs["O2 remainder"].model
    fp32_share = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32) / params
    checks = _checks(by, fp32_share)
    print(f"AdamW, {params / 1e6:.2f}M-parameter LM, CPU, {args.threads} threads, {repeats} rounds")
    header = ["config", "B/param", "in step", "after", "at the call", "peak MiB", "step ms", "steps/s"]
    print(format_table(header, rows))
    for check in checks:
        verdict = "ok" if check["met"] else "MISSED"
        print(f"{check['name']}: {check['value']:.2f} (target {check['target']}) {verdict}")
    if args.json:
        write_json(args.json, {
            "benchmark": "memory", "environment": environment("cpu"), "size": size.__dict__,
            "parameters": params, "results": results, "targets": checks,
        })  # fmt: skip
    return 0


def _breakdown(by: dict[str, float]) -> str:
    """``weights 2.00 + grads 4.00 + ...``: the nonzero categories of one count."""
    return " + ".join(f"{k} {v:.2f}" for k, v in by.items() if v >= 0.005)


def _checks(by: dict[str, dict[str, Any]], fp32_share: float) -> list[dict[str, Any]]:
    """The targets; the remainder row's is 14 B per bf16 parameter and 16 per fp32 (norm) one."""
    sr = by["bf16 stochastic"]["bytes_per_param"]
    remainder_target = TARGET_REMAINDER_BYTES + 2 * fp32_share
    ratio = by["O2 (masters)"]["steps_per_s"] / by["O1 (autocast)"]["steps_per_s"]
    remainder = by["O2 remainder"]["bytes_per_param"]
    speed = by["O2 remainder"]["steps_per_s"] / by["O2 (masters)"]["steps_per_s"]
    return [
        {"name": "O2 remainder B/param", "value": remainder,
         "target": f"<= {remainder_target:.2f} (14 per bf16 parameter, 16 per fp32 norm one)",
         "met": round(remainder, 2) <= round(remainder_target, 2)},  # + AdamW's 0-dim step counts
        {"name": "O2 remainder / O2 steps/s", "value": speed, "target": ">= 1.0", "met": speed >= 1.0},
        {"name": "bf16 stochastic B/param", "value": sr, "target": f"<= {TARGET_SR_BYTES}",
         "met": sr <= TARGET_SR_BYTES},
        {"name": "O2 / O1 steps/s", "value": ratio, "target": f">= {TARGET_O2_VS_O1}",
         "met": ratio >= TARGET_O2_VS_O1},
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
