"""Training steps/s of a ``torch.compile``-d model against the same model in eager, under AMPPrecision.

The model is a small pre-norm transformer (token + position embeddings, ``--layers`` encoder layers
of width ``--d-model``, mean pooling, a linear head; batch 32 x 32 tokens). Its ``nn.Module`` is
wrapped in ``torch.compile(..., fullgraph=True)`` inside a LightningModule trained by
``Trainer(plugins=[AMPPrecision(...)])``, so a graph break would stop the run instead of hiding in
the numbers. Set-ups, each eager and compiled:

  bf16         AMPPrecision("bf16-mixed")
  bf16 + fp32  AMPPrecision("bf16-mixed", fp32_modules=(nn.LayerNorm,)): the force_fp32 hooks
               are traced into the graph
  fp16         AMPPrecision("16-mixed"): fp16 autocast with LossScaler, on CPU too

A callback times each training batch (forward, backward, optimizer step) after ``--warmup``
batches; a run's steps/s is one over its median step. ``torch._dynamo.reset()`` runs once per
set-up: the first compiled run compiles, later rounds reuse its graph (the fp32_modules set-up
recompiles in each fit, which registers its hooks anew). "compile s" is the first batch of the
first compiled run minus the first batch of the eager run of the same round; inductor's FX-graph
and AOTAutograd caches are off unless ``--warm-cache``, so it is a cold compile.
Eager and compiled runs alternate in each round (the order rotates), and "compiled/eager" is the
median over rounds of the per-round ratio. The backend is inductor (it needs a C++ compiler; gcc
here) unless ``--backend aot_eager``; ``--quick`` uses aot_eager and a 1-layer model, as a smoke
run, since inductor spends tens of seconds per graph on a small CPU.

Run ``python benchmarks/compile_speed.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from _common import environment, format_table, write_json
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from training_speed import BatchTimer, quiet_lightning

from amp_plugin import AMPPrecision

VOCAB, SEQ_LEN, BATCH = 8, 32, 32
SETUPS: dict[str, dict[str, Any]] = {
    "bf16": {"precision": "bf16-mixed"},
    "bf16 + fp32": {"precision": "bf16-mixed", "fp32_modules": (nn.LayerNorm,)},
    "fp16": {"precision": "16-mixed"},
}
FULL = {"rounds": 5, "steps": 20, "warmup": 3, "layers": 2, "d_model": 128, "backend": "inductor"}
QUICK = {"rounds": 1, "steps": 4, "warmup": 2, "layers": 1, "d_model": 32, "backend": "aot_eager"}


class Transformer(nn.Module):
    """Embeddings, a pre-norm encoder, mean pooling and a head: the part that gets compiled."""

    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 4, 2 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB))

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(self.embed(tokens) + self.pos).mean(dim=1))
        return out


class Classifier(LightningModule):
    def __init__(self, d_model: int, layers: int, backend: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = Transformer(d_model, layers)
        self.net = net if backend is None else torch.compile(net, fullgraph=True, backend=backend)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self.net(tokens).float(), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FirstBatch(BatchTimer):
    """A BatchTimer that also keeps the first batch's wall time (where compilation happens)."""

    first_seconds = 0.0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if not self._seen:
            self.first_seconds = time.perf_counter() - self._start
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)


def _loader(batches: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH * batches, SEQ_LEN), generator=g)
    labels = nn.functional.one_hot(tokens, VOCAB).sum(1).argmax(1)
    return DataLoader(TensorDataset(tokens, labels), batch_size=BATCH)


def train_once(setup: str, backend: str | None, cfg: dict[str, Any]) -> tuple[float, float]:
    """(steps/s over the timed batches, seconds of the first batch) of one ``Trainer.fit``."""
    model = Classifier(cfg["d_model"], cfg["layers"], backend)
    timer = FirstBatch("cpu", cfg["warmup"])
    total = cfg["warmup"] + cfg["steps"]
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=total, plugins=[AMPPrecision(device="cpu", **SETUPS[setup])],
        callbacks=[timer], logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, _loader(total))
    return 1.0 / statistics.median(timer.step_seconds), timer.first_seconds


def run(cfg: dict[str, Any], setups: Sequence[str]) -> list[dict[str, Any]]:
    results = []
    for setup in setups:
        samples: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
        # Compile once per set-up: later rounds' fresh models of the same class reuse the graph
        # (parameters are graph inputs), so they time steady-state steps only.
        torch._dynamo.reset()
        for r in range(cfg["rounds"]):
            for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
                samples[mode].append(train_once(setup, cfg["backend"] if mode == "compiled" else None, cfg))
            print(f"  {setup} round {r + 1}/{cfg['rounds']} done", file=sys.stderr, flush=True)
        eager, compiled = samples["eager"], samples["compiled"]
        results.append({
            "setup": setup,
            "eager_steps_per_s": [s for s, _ in eager],
            "compiled_steps_per_s": [s for s, _ in compiled],
            "ratio": statistics.median(c[0] / e[0] for c, e in zip(compiled, eager, strict=True)),
            "compile_s": compiled[0][1] - eager[0][1],
            "first_batch_s": {"eager": [f for _, f in eager], "compiled": [f for _, f in compiled]},
        })  # fmt: skip
    return results


def report(results: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    rows = [
        [r["setup"], f"{statistics.median(r['eager_steps_per_s']):.1f}",
         f"{statistics.median(r['compiled_steps_per_s']):.1f}", f"{r['ratio']:.2f}x", f"{r['compile_s']:.1f}"]
        for r in results
    ]  # fmt: skip
    table = format_table(["set-up", "eager steps/s", "compiled steps/s", "compiled/eager", "compile s"], rows)
    model = f"{cfg['layers']}-layer transformer, d_model {cfg['d_model']}, batch {BATCH} x {SEQ_LEN} tokens"
    return f"{table}\n\nbackend {cfg['backend']}, fullgraph=True; {model}; threads {torch.get_num_threads()}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--backend", choices=("inductor", "aot_eager"), help="default inductor (quick: aot_eager)")
    add("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    for name in ("rounds", "steps", "warmup", "layers"):
        add(f"--{name}", type=int, help=f"default {FULL[name]} (quick {QUICK[name]})")
    add("--d-model", type=int, dest="d_model", help=f"default {FULL['d_model']} (quick {QUICK['d_model']})")
    add("--threads", type=int, default=1, help="torch intra-op threads (default 1: a shared machine)")
    add("--warm-cache", action="store_true", help="let compiles reuse inductor's on-disk caches")
    add("--quick", action="store_true", help="aot_eager, a 1-layer model, few steps: a smoke run")
    add("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    preset = QUICK if args.quick else FULL
    cfg = {k: getattr(args, k) or v for k, v in preset.items()}
    torch.set_num_threads(args.threads)
    if not args.warm_cache:  # "compile s" is then what a first run pays, not a cache lookup
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    quiet_lightning()
    results = run(cfg, args.setups)
    print(report(results, cfg))
    payload = {
        "benchmark": "compile_speed",
        "environment": environment("cpu"),
        "settings": {
            **cfg, "fullgraph": True, "warm_cache": args.warm_cache, "batch": BATCH, "seq_len": SEQ_LEN
        },
        "results": results,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
