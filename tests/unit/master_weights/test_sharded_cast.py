"""``cast_model`` on parameters ``fully_shard`` (FSDP2) has sharded already: refused before anything changes.

FSDP2 keeps each sharded parameter's storage itself; replacing ``.data`` with a half copy does
not reach it (the weights came back fp32 under Lightning's ``ModelParallelStrategy``), and fp32
masters of DTensors would break the masters' foreach copies. Half weights that are half before
``fully_shard`` need no cast and pass.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.master_weights import cast_model
from tests._ranks import run_ranks

WORLD = 2


def _sharded(dtype: torch.dtype = torch.float32) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 6)).to(dtype)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model


def _worker(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    cases = (("O2", torch.bfloat16, True), ("remainder", torch.bfloat16, "remainder"),
             ("true", torch.bfloat16, False), ("true16", torch.float16, False))  # fmt: skip
    for name, dtype, masters in cases:
        model = _sharded()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            cast_model(model, dtype, master_weights=masters)
            results[name] = "cast"
        except ValueError as error:
            results[name] = str(error)
        after = model.state_dict()
        results[f"{name}_unchanged"] = all(
            after[k].dtype == v.dtype and torch.equal(after[k].full_tensor(), v.full_tensor())
            for k, v in before.items()
        )
    # Fabric's order: the plugin casts (masters made), then the strategy shards, then the optimizer.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from amp_plugin._fit_start import check_fit_start

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 6))
    cast_model(model, torch.bfloat16, master_weights="remainder")
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    try:
        opt = torch.optim.AdamW(model.parameters())
        check_fit_start(model, [opt], "cpu", torch.bfloat16, False, "master")
        results["sharded_after_cast"] = "passed"
    except ValueError as error:
        results["sharded_after_cast"] = str(error)
    model = _sharded(torch.bfloat16)  # half before sharding: nothing to cast
    masters = cast_model(model, torch.bfloat16, keep_fp32=(), master_weights=False)
    results["half_before"] = (len(masters), sorted({str(p.dtype) for p in model.parameters()}))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("sharded_cast"), WORLD)


@pytest.mark.parametrize("case", ["O2", "remainder", "true", "true16"])
def test_casting_sharded_parameters_is_refused_with_a_hint_and_changes_nothing(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for result in ranks:
        message = result[case]
        assert message.startswith("cast_model(") and "DTensor" in message and "HINT:" in message, message
        assert "fully_shard" in message and "MixedPrecisionPolicy" in message
        assert result[f"{case}_unchanged"]


def test_a_model_half_before_sharding_passes_with_nothing_to_cast(ranks: list[dict[str, Any]]) -> None:
    assert [r["half_before"] for r in ranks] == [[0, ["torch.bfloat16"]]] * WORLD


def test_masters_made_before_sharding_are_refused_at_fit_start_with_the_same_hint(
    ranks: list[dict[str, Any]],
) -> None:
    """Fabric casts before its strategy shards: the optimizer then steps DTensors with no master."""
    for result in ranks:
        message = result["sharded_after_cast"]
        assert message.startswith("AMPPrecision(a module whose parameters are sharded DTensors"), message
        assert "0.weight" in message and "MixedPrecisionPolicy" in message and "HINT:" in message
