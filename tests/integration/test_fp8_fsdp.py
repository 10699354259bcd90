"""fp8 layers under torch's ``fully_shard`` (FSDP2): 2 gloo processes on CPU, an inf on one rank only.

Each rank converts the same TinyLM to fp8 (``amp_plugin.fp8.convert``, before sharding, as
``AMPPrecision.convert_module`` does), shards every block and the root, and trains under bf16
autocast with the guard ``AMPPrecision`` gives bf16 (a ``LossScaler`` with a static scale of 1,
whose inf flag is agreed across the process group). At ``POISON`` an inf lands in rank 1's shard
of one fp8 layer's weight gradient: both ranks must skip, their parameters must stay as they
were, and the run must match the same fp8 model trained unsharded on the whole batch.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # inherited by the spawned ranks

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from amp_plugin import LossScaler, _imports
from amp_plugin.fp8 import Float8, convert, float8_layer_names, plain_tensor
from tests._fp8_models import TinyLM, batches, lm_loss
from tests._ranks import run_ranks

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = [
    pytest.mark.skipif(
        _imports.torchao_error() is not None, reason=f"needs torchao 0.18 ({_imports.torchao_error()})"
    ),
    pytest.mark.slow,
]
WORLD, STEPS, POISON = 2, 4, 2
CASES = {"tensorwise": Float8(min_features=64), "fp8 all-gather": Float8(min_features=64, all_gather=True)}


def _model(spec: Float8) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyLM()
    convert(model, spec)
    return model


def _train(model: torch.nn.Module, rank: int | None) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    guard = LossScaler("cpu", init_scale=1.0, dynamic=False)
    skipped, before, after = [], [], []
    for step, (tokens, targets) in enumerate(batches(STEPS)):
        if rank is not None:
            tokens, targets = tokens.chunk(WORLD)[rank], targets.chunk(WORLD)[rank]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, tokens, targets)
        guard.scale(loss).backward()
        if step == POISON:
            before = _full(model)
            if rank in (None, 1):
                grad = model.blocks[0].fc1.weight.grad
                local = grad.to_local() if rank is not None else grad
                local.view(-1)[0] = float("inf")  # rank 1's shard only
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        skipped.append(guard.last_step_skipped)
        if step == POISON:
            after = _full(model)
    return {"skipped": skipped, "poison_kept": before == after, "params": _full(model)}


def _full(model: torch.nn.Module) -> list[list[float]]:
    params = [getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters()]
    return [plain_tensor(p.detach()).float().flatten().tolist() for p in params]


def _cpu_mesh() -> Any:
    """The 2 ranks on the CPU: fully_shard's default mesh is on torch's accelerator (CUDA where present)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _convert_after_sharding() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    sharded = fully_shard(model, mesh=_cpu_mesh())
    before = {k: v.full_tensor().clone() for k, v in sharded.state_dict().items()}
    try:
        convert(model, Float8(min_features=64))
        error = ""
    except ValueError as err:
        error = str(err)
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    refused_layers = len(float8_layer_names(model))
    # The supported order (a LightningModule's configure_model): convert, shard; then the plugin's
    # convert_module finds every chosen layer converted and only reports them.
    torch.manual_seed(0)
    model = TinyLM()
    first = convert(model, Float8(min_features=64))
    fully_shard(model, mesh=_cpu_mesh())
    again = convert(model, Float8(min_features=64))
    return {
        "error": error,
        "fp8_layers": refused_layers,
        "unchanged": unchanged,
        "report_again": [list(first.converted_names), list(again.converted_names)],
    }


def _flat(params: list[list[float]]) -> torch.Tensor:
    return torch.cat([torch.tensor(p) for p in params])


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    for case, spec in CASES.items():
        try:
            model, mesh = _model(spec), _cpu_mesh()
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            results[case] = {**_train(model, rank), "fp8_layers": len(float8_layer_names(model))}
            state = model.state_dict()
            results[case]["state_types"] = sorted({type(v.to_local()).__name__ for v in state.values()})
        except Exception as err:  # reported, so the test can say which case does not run on CPU
            results[case] = {"error": f"{type(err).__name__}: {err}"[:500]}
    results["converted after sharding"] = _convert_after_sharding()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("fp8_fsdp"), WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_inf_on_one_rank_skips_on_both_and_matches_unsharded(ranks: list[dict[str, Any]], case: str) -> None:
    for result in ranks:
        assert "error" not in result[case], result[case]
        assert result[case]["fp8_layers"] == 7
        assert result[case]["skipped"] == [False, False, True, False]
        assert result[case]["poison_kept"]
        assert result[case]["state_types"] == ["Tensor"]  # no torchao subclass in the sharded state dict
    start = _flat(_full(_model(CASES[case])))
    reference = _train(_model(CASES[case]), None)
    assert reference["skipped"] == [False, False, True, False]
    # Each rank casts its half batch to fp8 with its own scale, so sharded and unsharded runs differ
    # by fp8 rounding (Adam amplifies it in its first steps); their updates must still agree: the
    # relative difference measured on CPU is 10% (both cases), the bound 20%.
    want = _flat(reference["params"]) - start
    got = _flat(ranks[0][case]["params"]) - start
    assert ranks[0][case]["params"] == ranks[1][case]["params"]
    assert (got - want).norm() <= 0.2 * want.norm(), ((got - want).norm() / want.norm()).item()


def test_converting_a_sharded_model_is_refused_before_anything_changes(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        case = result["converted after sharding"]
        assert "sharded already" in case["error"] and "HINT: call amp_plugin.fp8.convert" in case["error"]
        assert case["fp8_layers"] == 0 and case["unchanged"]
        first, again = case["report_again"]
        assert first == again and len(first) == 7


def test_fp8_under_lightnings_model_parallel_strategy(tmp_path: Path) -> None:
    """Converted in configure_model, then fully_shard: the plugin reports the layers; an inf skips on both."""
    script = Path(__file__).with_name("_model_parallel_fp8_fit.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for result in ranks:
        assert result["fp8_layers"] == 7 and len(result["reported"]) == 7
        assert result["skipped"] == [False, False, True, False]
        assert result["guard_skipped"] == 1
        assert result["params_equal_across_ranks"] and result["params_finite"]
