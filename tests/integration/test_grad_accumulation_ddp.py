"""fp32 gradient accumulation under DDP, in 2 gloo processes: the step sees the ranks' averaged fp32 sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from amp_plugin.grad_accumulation import Fp32GradAccumulation
from tests._ranks import run_ranks

pytestmark = pytest.mark.slow  # processes: the one-thread pass of the test command leaves them out

WORLD, MICRO = 2, 8


def _rows(rank: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s micro-batch gradients: bf16 rows 2**10 apart in size, and fp32 rows."""
    g = torch.Generator().manual_seed(3 + rank)
    half = 1 + torch.rand(MICRO, 64, generator=g)
    half[1:] *= 2.0**-10
    return half.bfloat16(), torch.randn(MICRO, 8, generator=g)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))  # accumulated in fp32 sums
        self.s = nn.Parameter(torch.ones(8))  # fp32: DDP's own reduction

    def forward(self, half: Tensor, full: Tensor) -> Tensor:
        return (self.w * half).float().sum() + (self.s * full).sum()


def _fp32_sum(rows: Tensor) -> Tensor:
    total = rows[0].float()
    for row in rows[1:]:
        total.add_(row)  # fp32 += bf16, as the accumulation's hook adds
    return total


def _worker(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = _Model()
    ddp = DistributedDataParallel(model)
    accumulation = Fp32GradAccumulation(model.parameters())
    accumulation.reduce_across(ddp)
    half, full = _rows(rank)
    for k in range(MICRO):
        if k < MICRO - 1:
            with ddp.no_sync():
                ddp(half[k], full[k]).backward()
        else:
            ddp(half[k], full[k]).backward()
    accumulation.flush_([(model.w, model.w)])
    sums = [_fp32_sum(_rows(r)[0]) for r in range(WORLD)]
    expected = (sums[0] / WORLD + sums[1] / WORLD).bfloat16()
    naive = [_rows(r)[0][0].clone() for r in range(WORLD)]
    for r in range(WORLD):
        for row in _rows(r)[0][1:]:
            naive[r] += row  # torch's own accumulation in the bf16 .grad
    full_mean = (sum(_rows(r)[1].sum(0) for r in range(WORLD)) / WORLD).tolist()
    return {
        "w": model.w.grad.float().tolist(),
        "expected": expected.float().tolist(),
        "naive": ((naive[0] + naive[1]) / WORLD).float().tolist(),
        "s": model.s.grad.tolist(),
        "s_expected": full_mean,
        "pending": accumulation.pending(),
    }


def test_ddp_averages_the_fp32_sums_of_every_rank(tmp_path: Path) -> None:
    ranks = run_ranks(_worker, tmp_path, WORLD)
    for result in ranks:
        assert result["w"] == result["expected"]  # the ranks' fp32 sums averaged, rounded once to bf16
        assert result["w"] != result["naive"]  # adding up in the bf16 .grad loses the small micro-batches
        assert torch.allclose(torch.tensor(result["s"]), torch.tensor(result["s_expected"]), rtol=1e-6)
        assert result["pending"] == 0
    assert ranks[0]["w"] == ranks[1]["w"] and ranks[0]["s"] == ranks[1]["s"]


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.u = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, use_u: bool) -> Tensor:
        return self.w.float().sum() + (self.u.float().sum() if use_u else 0)


def _unused_worker(rank: int) -> dict[str, Any]:
    """``u`` gets gradients on rank 0 only: rank 1 holds no fp32 sum for it when DDP reduces."""
    from torch.nn.parallel import DistributedDataParallel

    model = _Branches()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    accumulation = Fp32GradAccumulation(model.parameters())
    accumulation.reduce_across(ddp)
    with ddp.no_sync():
        ddp(rank == 0).backward()
    ddp(rank == 0).backward()
    accumulation.flush_([(model.w, model.w), (model.u, model.u)])
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {name: None if g is None else g.float().tolist() for name, g in grads.items()}


def test_a_parameter_used_on_one_rank_only_is_averaged_with_zeros(tmp_path: Path) -> None:
    ranks = run_ranks(_unused_worker, tmp_path, WORLD)
    for result in ranks:
        assert result["w"] == [2.0] * 4  # 2 micro-batches of 1 on each rank, averaged
        assert result["u"] == [1.0] * 4  # rank 0's 2, rank 1's nothing: averaged 1
