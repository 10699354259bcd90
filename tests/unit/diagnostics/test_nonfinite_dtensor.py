"""``nonfinite_gradients`` under torch's ``fully_shard`` (FSDP2): 2 gloo processes, an inf in one shard.

Every rank must name the parameter, with the counts of the whole gradient: the forensics of a
skipped step are the same wherever they are read.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.diagnostics import nonfinite_gradients
from tests._ranks import run_ranks

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))  # fully_shard's default mesh is CUDA's where CUDA is present
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    model(torch.randn(3, 4)).sum().backward()
    results["clean"] = [str(g) for g in nonfinite_gradients(model)]
    grad = model[2].weight.grad
    results["grad_type"] = type(grad).__name__
    if rank == 1:  # rank 1's shard only: rank 0's own gradients are finite
        grad.to_local().view(-1)[:2] = float("inf")
        model[0].bias.grad.to_local().view(-1)[0] = float("nan")
    results["poisoned"] = [str(g) for g in nonfinite_gradients(model.named_parameters())]
    results["limited"] = [str(g) for g in nonfinite_gradients(model, limit=1)]
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("nonfinite_dtensor"), WORLD)


def test_every_rank_names_the_parameter_whose_shard_went_non_finite(ranks: list[dict[str, Any]]) -> None:
    assert [r["grad_type"] for r in ranks] == ["DTensor", "DTensor"]
    expected = ["0.bias (nan in 1 of 8 values, float32)", "2.weight (inf in 2 of 48 values, float32)"]
    assert [r["poisoned"] for r in ranks] == [expected, expected]
    assert [r["limited"] for r in ranks] == [expected[:1], expected[:1]]


def test_finite_sharded_gradients_name_nothing(ranks: list[dict[str, Any]]) -> None:
    assert [r["clean"] for r in ranks] == [[], []]
