"""LossScaler under torch's fully_shard (FSDP2) on CPU: 2 gloo processes against an unsharded reference.

One spawn runs every case on both ranks and writes what each rank saw; the parent process
trains the same model unsharded on the whole batch and compares. Each rank trains on its half
of the batch; FSDP2 averages the gradients, which equals the gradient of the whole batch's mean
loss, so the sharded and the unsharded runs take the same steps up to fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from tests._ranks import run_ranks

WORLD, STEPS, POISON_STEP, MAX_NORM = 2, 6, 2, 0.5
CASES = {  # name: (AdamW options, sync_found_inf, clip)
    "foreach": ({"foreach": True}, "auto", True),
    "fused": ({"fused": True}, "auto", True),
    # Without a clip only the agreed inf flag can make rank 0 skip (a clip norm is global already).
    "foreach, no clip": ({"foreach": True}, "auto", False),
    "fused, no clip": ({"fused": True}, "auto", False),
    "no agreement, no clip": ({"foreach": True}, False, False),  # the control
    # The guard of the precisions without a loss scaler (a static scale of 1): the same agreement.
    "guard, foreach, no clip": ({"foreach": True}, "auto", False),
    "guard, fused, no clip": ({"fused": True}, "auto", False),
    "guard, fused": ({"fused": True}, "auto", True),
}


def _scaler(case: str, sync: Any) -> LossScaler:
    if case.startswith("guard"):
        return LossScaler("cpu", init_scale=1.0, dynamic=False, sync_found_inf=sync)
    return LossScaler("cpu", init_scale=2.0**10, sync_found_inf=sync)


def _model() -> nn.Module:
    torch.manual_seed(0)  # uneven shards: 3 rows split 2 + 1
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 8, generator=g)
    return x, torch.randn(8, 3, generator=g)


def _train(model: nn.Module, case: str, rank: int | None) -> dict[str, Any]:
    """Train STEPS steps; at POISON_STEP an inf lands in rank 1's gradient only."""
    opts, sync, clip = CASES[case]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opts)
    scaler = _scaler(case, sync)
    x, y = _batch()
    if rank is not None:
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    norms, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == POISON_STEP and rank in (None, 1):
            grad = model[2].weight.grad
            local = grad.to_local() if rank is not None else grad
            local.view(-1)[0] = float("inf")  # rank 1's shard only; rank 0's is finite
        if clip:
            norms.append(scaler.clip_grad_norm_(opt, MAX_NORM).item())
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    params = [p.full_tensor() if rank is not None else p for p in model.parameters()]
    return {
        "norms": norms,
        "skipped": skipped,
        "params": [p.detach().flatten().tolist() for p in params],
        "scale": scaler.get_scale(),
    }


def _refused_sharded_flag(model: nn.Module) -> str:
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), LossScaler("cpu")
    scaler.scale(model(_batch()[0]).sum()).backward()
    try:
        scaler.clip_grad_norm_(opt, 1.0, sharded=True)
    except ValueError as err:
        return str(err)
    return "accepted"


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    # A CPU mesh, named: fully_shard's default mesh is on torch's accelerator, CUDA where there is one.
    cpu = init_device_mesh("cpu", (WORLD,))
    for case in CASES:
        model = _model()
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=cpu)
        results[case] = {**_train(model, case, rank), "param_type": type(model[2].weight).__name__}
    results["sharded=True"] = _refused_sharded_flag(model)
    # HSDP: replicated across the 2 ranks, each shard group of one rank, so every rank holds
    # the whole gradient: the norm must not be summed over the replicate dimension.
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    placements = [str(p) for p in model[2].weight.placements]
    results["hsdp"] = {**_train(model, "foreach", rank), "placements": placements}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("fsdp"), WORLD)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    return {case: _train(_model(), case, None) for case in CASES if CASES[case][1] == "auto"}


AGREED = [case for case in CASES if CASES[case][1] == "auto"]


@pytest.mark.parametrize("case", AGREED)
def test_inf_in_one_shard_makes_every_rank_skip(ranks: list[dict[str, Any]], case: str) -> None:
    expected = [step == POISON_STEP for step in range(STEPS)]
    assert ranks[0][case]["param_type"] == "DTensor"
    assert [r[case]["skipped"] for r in ranks] == [expected, expected]
    assert ranks[0][case]["scale"] == ranks[1][case]["scale"] == (1.0 if case.startswith("guard") else 2.0**9)


def test_without_agreement_only_the_poisoned_rank_skips(ranks: list[dict[str, Any]]) -> None:
    """The control for the test above: sync_found_inf=False leaves rank 0 stepping alone."""
    skipped = [r["no agreement, no clip"]["skipped"][POISON_STEP] for r in ranks]
    assert skipped == [False, True]


@pytest.mark.parametrize("case", AGREED)
def test_sharded_run_matches_the_unsharded_reference(
    ranks: list[dict[str, Any]], reference: dict[str, dict[str, Any]], case: str
) -> None:
    ref = reference[case]
    assert ref["skipped"] == ranks[0][case]["skipped"]
    for rank in ranks:
        assert rank[case]["params"] == ranks[0][case]["params"]
        for got, want in zip(rank[case]["params"], ref["params"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        if not CASES[case][2]:
            continue
        assert not math.isfinite(rank[case]["norms"][POISON_STEP])  # also on rank 0: its shard is finite
        norms = [n for step, n in enumerate(rank[case]["norms"]) if step != POISON_STEP]
        want = [n for step, n in enumerate(ref["norms"]) if step != POISON_STEP]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want), rtol=1e-5, atol=0.0)


def test_sharded_flag_is_refused_for_dtensor_gradients(ranks: list[dict[str, Any]]) -> None:
    """Their norm is global already; the flag would count every shard's norm once per rank."""
    assert all("sharded=True" in r["sharded=True"] and "HINT" in r["sharded=True"] for r in ranks)


def test_hsdp_norm_is_not_summed_over_replicas(
    ranks: list[dict[str, Any]], reference: dict[str, dict[str, Any]]
) -> None:
    ref, expected = reference["foreach"], [step == POISON_STEP for step in range(STEPS)]
    assert ranks[0]["hsdp"]["placements"] == ["R", "S(0)"]  # (Replicate(), Shard(0))
    for rank in ranks:
        assert rank["hsdp"]["skipped"] == expected  # rank 0's replica was finite: the flag is agreed
        norms = [n for step, n in enumerate(rank["hsdp"]["norms"]) if step != POISON_STEP]
        want = [n for step, n in enumerate(ref["norms"]) if step != POISON_STEP]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want), rtol=1e-5, atol=0.0)
        for got, want_p in zip(rank["hsdp"]["params"], ref["params"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want_p), rtol=1e-5, atol=1e-6)
