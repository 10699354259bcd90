"""A small transformer for the fp8 tests: every inner dimension a multiple of 16, so fp8 can take it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB, DIM, SEQ = 96, 64, 16


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = 4

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, ``depth`` blocks, a final norm and an LM head (``tied``: the head shares the embedding)."""

    def __init__(self, depth: int = 2, dim: int = DIM, vocab: int = VOCAB, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(count: int, batch: int = 2, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Token sequences from a fixed random bigram table: learnable, the same on every call.

    Two sequences of 16 tokens a batch by default: CPUs without an fp8 matmul run torch's
    ``_scaled_mm`` at a few MFLOP/s, so every token is a test's time.
    """
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB,), generator=gen)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
        seq = [start]
        for _ in range(SEQ):
            seq.append(table[seq[-1]])
        tokens = torch.cat(seq, dim=1)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
