"""FP8 training with ``AMPPrecision("bf16-mixed", fp8=...)``: one small language model in bf16 and in fp8.

A 2-block transformer (width 64, every Linear dimension a multiple of 16) learns a random bigram
table. It is trained twice from the same weights on the same batches: under ``"bf16-mixed"``, and
with the eligible Linear layers' matmuls in fp8 through torchao. The script prints which layers
fp8 took (and why not the others), both loss curves and the gap between them.

The model is small, so the default layer rule (both dimensions >= 1024, where fp8 pays on a GPU)
would keep every layer in bf16; the example lowers ``min_features`` to show fp8's numerics. On a
CPU fp8 runs through ``torch._scaled_mm``'s CPU kernel and is slower than bf16: the speed-up needs
a GPU with fp8 tensor cores (H100-class), see ``benchmarks/fp8.py``.

    python examples/fp8.py                     # about 10 s on 2 CPU cores
    python examples/fp8.py --recipe rowwise
    python examples/fp8.py --smoke             # a few steps, for the tests

Needs torchao: ``pip install "amp_plugin[fp8]"``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # CPU: torchao's CUDA kernels cannot load

import torch
from lightning.pytorch import LightningModule, Trainer
from quickstart import quiet_lightning
from torch import Tensor, nn
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision
from amp_plugin.fp8 import RECIPES, Float8

VOCAB, SEQ = 128, 32


def quiet() -> None:
    """Keep the console to AMPPrecision's fp8 layer report, the loss table and the summary."""
    quiet_lightning()  # Lightning's banners and its advice on workers and TF32: nothing this comparison needs
    # torchao's import says which optional CUDA extensions it skipped, and torch that torchao
    # registers an enum it no longer needs to: neither is about this model.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2, self.heads = nn.LayerNorm(dim), nn.LayerNorm(dim), heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class LanguageModel(LightningModule):
    def __init__(self, dim: int, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)  # both runs start from the same weights
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.head(self.norm(self.blocks(self.embed(tokens))))
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


def bigram_batches(
    count: int, batch: int = 16, vocab: int = VOCAB, length: int = SEQ, seed: int = 1
) -> list[tuple[Tensor, Tensor]]:
    """Token sequences from a fixed random bigram table (learnable; the same on every call)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab,), generator=gen)
    out = []
    for _ in range(count):
        seq = [torch.randint(0, vocab, (batch, 1), generator=gen)]
        for _ in range(length):
            seq.append(table[seq[-1]])
        tokens = torch.cat(seq, dim=1)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train(plugin: AMPPrecision, dim: int, steps: int, batch: int) -> tuple[list[float], float]:
    model = LanguageModel(dim)
    trainer = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, DataLoader(bigram_batches(steps, batch), batch_size=None))
    return model.losses, time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=RECIPES, default="tensorwise", help="torchao's fp8 recipe")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--dim", type=int, default=64, help="model width, a multiple of 16 (default 64)")
    parser.add_argument(
        "--min-features",
        type=int,
        default=64,
        help="the smallest Linear dimension fp8 takes (default 64 here; the library's default is 1024)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default: 1, steady on a busy machine)"
    )
    parser.add_argument("--smoke", action="store_true", help="3 small steps, for the tests")
    args = parser.parse_args(argv)
    quiet()
    try:  # before anything trains: without torchao, one line that says what to install
        plugin = AMPPrecision("bf16-mixed", fp8=Float8(args.recipe, min_features=args.min_features))
    except ImportError as err:
        raise SystemExit(f"fp8.py: {err}") from None
    torch.set_num_threads(args.threads)
    # fp8 matmuls are emulated on most CPUs (torch._scaled_mm at a few MFLOP/s): a smoke run is small.
    steps, batch = (3, 4) if args.smoke else (args.steps, 16)

    bf16, bf16_s = train(AMPPrecision("bf16-mixed"), args.dim, steps, batch)
    fp8, fp8_s = train(plugin, args.dim, steps, batch)

    # AMPPrecision said which layers fp8 took (and why not the others) as the fp8 run started.
    print(f"\n{'step':>6} {'bf16 loss':>10} {'fp8 loss':>10}")
    for step in sorted({0, *range(steps // 6 or 1, steps, steps // 6 or 1), steps - 1}):
        print(f"{step + 1:>6} {bf16[step]:>10.4f} {fp8[step]:>10.4f}")  # steps counted from 1
    tail = max(1, steps // 10)
    mean_bf16, mean_fp8 = sum(bf16[-tail:]) / tail, sum(fp8[-tail:]) / tail
    print("\nSummary")
    print(f"  recipe: {args.recipe}")
    print(f"  bf16 final loss (mean of last {tail}): {mean_bf16:.4f}")
    print(f"  fp8 final loss (mean of last {tail}): {mean_fp8:.4f}")
    print(f"  gap: {100 * (mean_fp8 - mean_bf16) / mean_bf16:+.2f}%")
    print(f"  time: bf16 {bf16_s:.1f} s, fp8 {fp8_s:.1f} s (CPU: fp8 is emulated, no speed-up expected)")


if __name__ == "__main__":
    main()
