"""Ranks agree on skips, clip norms and state: 2 real gloo processes on 127.0.0.1.

Spawning is slow (each process imports torch), so one spawn runs every scenario and writes
its observations to a JSON file per rank; the tests below read them. Everything that
compares ranks (parameters bit for bit, scales, optimizer step counters) is gathered inside
the workers, since ``ddp_spawn``-style workers send nothing back by themselves (trap 15).
Every "with sync" scenario has a "without sync" twin that shows the divergence, so these
tests can fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_plugin import LossScaler
from amp_plugin._distributed import (
    all_reduce_found_inf,
    check_process_group,
    check_sync_mode,
    global_norm,
    sync_enabled,
)
from amp_plugin._sharding import ShardAwareKernels
from amp_plugin.consistency import ConsistencyCheck, check_consistency
from amp_plugin.kernels import get_kernels
from tests._ranks import run_ranks

WORLD = 2
SCALE = 2.0**10
OVERFLOW_CASES = [
    ("sgd", "auto"),
    ("sgd", True),
    ("sgd", False),
    ("adamw-fused", "auto"),
    ("adamw-fused", False),
    ("adamw-fused-clip", "auto"),
    ("adamw-fused-clip", False),
]
NORM_TYPES = [2.0, 1.0, 3.0, math.inf]

Report = dict[str, Any]


# -- the workers (module level: torch.multiprocessing pickles them by name) ----------------------


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _all_equal(tensor: torch.Tensor) -> bool:
    gathered = _gather(tensor)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _flat(params: Iterator[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _count_all_reduce() -> Any:
    """Spies on the Python-level all-reduces (the scaler's); DDP's bucket all-reduce runs in C++."""
    return mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _ddp_backward(ddp: nn.Module, scaler: LossScaler, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # every rank sees other data
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()  # DDP all-reduces in here


def _overflow_scenario(kind: str, sync: Any, rank: int) -> Report:
    """A clean step, a step whose gradients rank 1 alone poisons after the all-reduce, a clean step."""
    model = _model()
    ddp = DistributedDataParallel(model)
    opt = _optimizer("sgd" if kind == "sgd" else "adamw-fused", model.parameters())
    scaler = LossScaler(init_scale=SCALE, sync_found_inf=sync)
    report: Report = {"skipped": [], "scales": [], "params_identical": [], "collectives": []}
    for step in range(3):
        opt.zero_grad()
        _ddp_backward(ddp, scaler, step, rank)
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        with _count_all_reduce() as count:
            if kind.endswith("-clip"):
                scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
        report["collectives"].append(count.call_count)
        report["skipped"].append([bool(t) for t in _gather(torch.tensor(scaler.last_step_skipped))])
        report["scales"].append([t.item() for t in _gather(torch.tensor(scaler.get_scale()))])
        report["params_identical"].append(_all_equal(_flat(model.parameters())))
        if step == 1:
            report["consistency_error"] = _consistency_error(scaler, ddp)
    if kind != "sgd":
        counters = torch.stack([opt.state[p]["step"].reshape(()) for p in model.parameters()])
        report["fused_step_counters"] = [t.tolist() for t in _gather(counters)]
    return report


def _consistency_error(scaler: LossScaler | None, parameters: Any, group: Any = None) -> str | None:
    try:
        check_consistency(scaler, parameters, group=group)
    except RuntimeError as err:
        return str(err)
    return None


def _consistency_scenario(rank: int) -> Report:
    """Three clean steps checked every 2 steps, then rank 1 alone overrides its scale."""
    model = _model()
    ddp = DistributedDataParallel(model)
    opt = _optimizer("sgd", model.parameters())
    scaler = LossScaler(init_scale=SCALE)
    check = ConsistencyCheck(every_n_steps=2)
    checked = []
    for step in range(3):
        opt.zero_grad()
        _ddp_backward(ddp, scaler, step, rank)
        scaler.step(opt)
        scaler.update()
        checked.append(check(step, scaler, ddp))
    opt.zero_grad()
    _ddp_backward(ddp, scaler, 3, rank)
    scaler.step(opt)
    scaler.update(new_scale=SCALE / 8 if rank == 1 else None)
    group = dist.new_group(list(range(WORLD)))
    return {
        "checked": checked,
        "scaler_error": _consistency_error(scaler, None),
        "scaler_error_in_group": _consistency_error(scaler, model.parameters(), group=group),
        "params_error": _consistency_error(None, ddp),
    }


def _shards(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Four gradient tensors known to every rank; rank r owns the tensors r, r + 2, ..."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(3, 5), (7,), (2, 2, 2), (11,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 10 for s in shapes]
    return params, grads, list(range(rank, len(shapes), WORLD))


def _sharded_norm_scenario(norm_type: float, fused: bool, poison: bool, rank: int) -> Report:
    params, grads, mine = _shards(rank)
    full = [p.clone().requires_grad_() for p in params]  # the reference: every shard in one process
    for p, g in zip(full, grads, strict=True):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(full, 0.5, norm_type)
    _optimizer("adamw-fused" if fused else "sgd", full).step()
    shard = [params[i].clone().requires_grad_() for i in mine]
    opt = _optimizer("adamw-fused" if fused else "sgd", shard)
    scaler = LossScaler(init_scale=SCALE)
    scaler.scale(sum((p * grads[i]).sum() for p, i in zip(shard, mine, strict=True))).backward()
    if poison and rank == 1:
        shard[0].grad.view(-1)[0] = float("nan")
    local = get_kernels("torch").norm([p.grad for p in shard], norm_type) / SCALE
    with _count_all_reduce() as count:
        norm = scaler.clip_grad_norm_(opt, 0.5, norm_type, sharded=True)
        scaler.step(opt)
        scaler.update()
    return {
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "local_norm": local.item(),
        "param_error": max((p - full[i]).abs().max().item() for p, i in zip(shard, mine, strict=True)),
        "skipped": [bool(t) for t in _gather(torch.tensor(scaler.last_step_skipped))],
        "collectives": count.call_count,
    }


def _unstepped_scenario(rank: int) -> Report:
    """Two optimizers; the second is unscaled but never stepped, and only rank 1 sees its inf."""
    model = _model()
    ddp = DistributedDataParallel(model)
    opt_a, opt_b = _optimizer("sgd", model[0].parameters()), _optimizer("sgd", model[2].parameters())
    scaler = LossScaler(init_scale=SCALE)
    _ddp_backward(ddp, scaler, 0, rank)
    if rank == 1:
        model[2].weight.grad[0, 0] = float("inf")
    with _count_all_reduce() as count:
        scaler.unscale_(opt_b)
        scaler.step(opt_a)
        scaler.update()
    return {
        "scales": [t.item() for t in _gather(torch.tensor(scaler.get_scale()))],
        "collectives": count.call_count,
    }


def _worker(rank: int) -> Report:
    return {
        "overflow": {f"{k}/{s}": _overflow_scenario(k, s, rank) for k, s in OVERFLOW_CASES},
        "consistency": _consistency_scenario(rank),
        "sharded": {
            f"{p}/{fused}/{poison}": _sharded_norm_scenario(p, fused, poison, rank)
            for p in NORM_TYPES
            for fused in (False, True)
            for poison in (False, True)
        },
        "unstepped": _unstepped_scenario(rank),
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[Report]:
    return run_ranks(_worker, tmp_path_factory.mktemp("ranks"), WORLD)


# -- found_inf is agreed on every path -----------------------------------------------------------


@pytest.mark.parametrize(("kind", "sync"), [c for c in OVERFLOW_CASES if c[1] is not False])
def test_with_sync_every_rank_skips_and_replicas_stay_identical(
    reports: list[Report], kind: str, sync: Any
) -> None:
    for report in reports:
        case = report["overflow"][f"{kind}/{sync}"]
        assert case["skipped"] == [[False, False], [True, True], [False, False]]
        assert case["scales"] == [[SCALE, SCALE], [SCALE / 2, SCALE / 2], [SCALE / 2, SCALE / 2]]
        assert case["params_identical"] == [True, True, True]
        assert case["collectives"] == [1, 1, 1]  # one 4-byte all-reduce per optimizer step
        assert case["consistency_error"] is None
        if kind != "sgd":  # the fused kernel skipped on both ranks: 2 real steps of 3
            assert all(c == [2.0] * 4 for c in case["fused_step_counters"])


@pytest.mark.parametrize("kind", [c[0] for c in OVERFLOW_CASES if c[1] is False])
def test_without_sync_the_replicas_diverge(reports: list[Report], kind: str) -> None:
    """The same run with sync_found_inf=False: proof that the test above can fail."""
    for report in reports:
        case = report["overflow"][f"{kind}/False"]
        assert case["skipped"][1] == [False, True]
        assert case["scales"][1] == [SCALE, SCALE / 2]
        assert case["params_identical"] == [True, False, False]
        assert case["collectives"] == [0, 0, 0]
        error = case["consistency_error"]
        assert "scale: 1024.0 on rank 0; 512.0 on rank 1" in error
        assert "parameter sum:" in error and "HINT:" in error
        if kind != "sgd":
            assert case["fused_step_counters"][0] != case["fused_step_counters"][1]


def test_a_flag_that_reaches_update_unstepped_is_agreed_too(reports: list[Report]) -> None:
    for report in reports:
        case = report["unstepped"]
        assert case["scales"] == [SCALE / 2, SCALE / 2]
        assert case["collectives"] == 2  # step(opt_a) and the never-stepped opt_b in update()


# -- the consistency check -----------------------------------------------------------------------


def test_consistency_check_runs_every_n_steps_and_passes_in_sync(reports: list[Report]) -> None:
    for report in reports:
        assert report["consistency"]["checked"] == [True, False, True]


def test_consistency_check_names_the_ranks_and_values_of_a_desynchronised_scale(
    reports: list[Report],
) -> None:
    for report in reports:
        case = report["consistency"]
        for key in ("scaler_error", "scaler_error_in_group"):
            error = case[key]
            # update(new_scale=...) also left the growth tracker and the step count behind
            assert error.startswith("check_consistency: the 2 ranks disagree on scale, growth tracker")
            assert "scale: 1024.0 on rank 0; 128.0 on rank 1" in error
            assert "parameter" not in error.split("HINT")[0]  # parameters are still identical
            assert "HINT:" in error
        assert case["params_error"] is None


# -- sharded clipping ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_sharded_clip_norm_is_the_norm_of_the_full_parameter_set(
    reports: list[Report], norm_type: float, fused: bool
) -> None:
    cases = [report["sharded"][f"{norm_type}/{fused}/False"] for report in reports]
    assert any(case["local_norm"] < case["ref_norm"] * (1 - 1e-3) for case in cases)  # local alone is wrong
    for case in cases:
        assert case["norm"] == pytest.approx(case["ref_norm"], rel=1e-6)
        assert case["param_error"] < 1e-6  # the step equals the full-set step on this rank's shard
        assert case["skipped"] == [False, False]
        assert case["collectives"] == 1  # the norm; its inf flag needs no second all-reduce


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_sharded_clip_of_a_nan_on_one_rank_skips_everywhere(
    reports: list[Report], norm_type: float, fused: bool
) -> None:
    for rank, report in enumerate(reports):
        case = report["sharded"][f"{norm_type}/{fused}/True"]
        assert not math.isfinite(case["norm"])
        assert math.isfinite(case["local_norm"]) == (rank == 0)
        assert case["skipped"] == [True, True]
        assert case["collectives"] == 1


# -- one process: no process group ---------------------------------------------------------------


def _scaled_grads(scaler: LossScaler) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(3, 8)).square().sum()).backward()
    return model, opt


def test_without_a_process_group_nothing_is_reduced() -> None:
    assert not dist.is_initialized()
    assert not sync_enabled("auto") and not sync_enabled(False)
    assert torch.equal(global_norm(torch.tensor(3.0), math.inf), torch.tensor(3.0))
    sharded, plain = LossScaler(init_scale=SCALE), LossScaler(init_scale=SCALE)
    (_, opt_a), (_, opt_b) = _scaled_grads(sharded), _scaled_grads(plain)
    assert torch.equal(sharded.clip_grad_norm_(opt_a, 0.1, sharded=True), plain.clip_grad_norm_(opt_b, 0.1))
    model, _ = _scaled_grads(LossScaler())
    check_consistency(LossScaler(), model)
    check_consistency(None, model.parameters())
    assert ShardAwareKernels(get_kernels("torch"), sharded=True).name == "torch"


def test_sync_true_without_a_process_group_raises() -> None:
    with pytest.raises(RuntimeError, match=r"sync_found_inf=True but torch.distributed is not initialised"):
        sync_enabled(True)
    scaler = LossScaler(sync_found_inf=True)
    with pytest.raises(RuntimeError, match=r"HINT: call torch.distributed.init_process_group"):
        _scaled_grads(scaler)  # at scale(), before any gradient is scaled or unscaled


@pytest.mark.parametrize("parameters", [5, nn.Linear, "weights", torch.ones(2)])
def test_check_consistency_refuses_what_is_not_a_module_or_its_parameters(parameters: object) -> None:
    with pytest.raises(TypeError, match=r"^check_consistency\(parameters=.*HINT: pass model"):
        check_consistency(LossScaler(), parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["yes", 1, None, "True"])
def test_bad_sync_mode_is_rejected(mode: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"^LossScaler\(sync_found_inf=.*\) is not allowed here: .*one of 'auto', True, False\. HINT",
    ):
        check_sync_mode(mode)
    with pytest.raises(ValueError, match=r"sync_found_inf=.*HINT"):
        LossScaler(sync_found_inf=mode)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^sync_enabled\(mode=.*\) is not allowed here: .*one of 'auto', True, False"
    ):
        sync_enabled(mode)  # type: ignore[arg-type]


def test_check_process_group_passes_none_and_groups_through() -> None:
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    assert check_process_group(None, "LossScaler") is None
    assert check_process_group(group, "LossScaler") is group


@pytest.mark.parametrize("group", ["world", 0, dist.group, [0, 1]])
def test_a_group_that_is_not_a_process_group_is_refused_by_every_entry_point(group: object) -> None:
    allowed = r"\) is not allowed here: .*None or a torch\.distributed\.ProcessGroup\. HINT: "
    with pytest.raises(TypeError, match=r"^LossScaler\(process_group=.*" + allowed):
        check_process_group(group, "LossScaler")
    model = nn.Linear(2, 1)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("sync_enabled", lambda: sync_enabled("auto", group)),
        ("all_reduce_found_inf", lambda: all_reduce_found_inf(torch.zeros(1), group)),
        ("global_norm", lambda: global_norm(torch.tensor(1.0), 2.0, group)),
        ("ShardAwareKernels", lambda: ShardAwareKernels(get_kernels("torch"), sharded=True, group=group)),
        ("check_consistency", lambda: check_consistency(None, model, group=group)),
        ("ConsistencyCheck", lambda: ConsistencyCheck(10, group=group)),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=rf"^{name}\(group=.*" + allowed):
            call()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: check_consistency(None, None), ValueError, r"nothing to compare.*HINT"),
        (
            lambda: check_consistency(object(), None),
            TypeError,
            r"scaler=object\) is not allowed here: .*a LossScaler.*HINT",
        ),
        (
            lambda: check_consistency(None, [1.0]),
            TypeError,
            r"\['float'\].*Allowed: a module or an iterable of tensors.*HINT",
        ),
        (lambda: ConsistencyCheck(0), ValueError, r"^ConsistencyCheck\(every_n_steps=0\) is not "
            r"allowed here: .*an"),
        (lambda: ConsistencyCheck(True), TypeError, r"^ConsistencyCheck\(every_n_steps=True\) is not"),
        (lambda: ConsistencyCheck("100"), TypeError, r"^ConsistencyCheck\(every_n_steps='100'\) is not"),
        (lambda: ConsistencyCheck(10)("5", None, nn.Linear(2, 1)), TypeError,
         r"^ConsistencyCheck\.__call__\(step='5'\) is not allowed here: .*an int >= 0.*HINT"),
        (lambda: ConsistencyCheck(10)(-10, None, nn.Linear(2, 1)), ValueError, r"step=-10\) is not allowed"),
        (lambda: global_norm(5.0), TypeError,  # type: ignore[arg-type]
         r"^global_norm\(local_norm=float\) is not allowed here: .*a one-element floating-point tensor"),
        (lambda: global_norm(torch.tensor(5.0), "2"), TypeError,  # type: ignore[arg-type]
         r"^global_norm\(norm_type='2'\) is not allowed here: .*a number, inf or -inf included.*HINT"),
        (lambda: global_norm(torch.tensor(5.0), float("nan")), ValueError, r"^global_norm\(norm_type=nan\)"),
        (lambda: all_reduce_found_inf(1.0), TypeError,  # type: ignore[arg-type]
         r"^all_reduce_found_inf\(found_inf=float\) is not allowed here: "
             r".*a one-element floating-point tensor"),
        (lambda: ShardAwareKernels("torch"), TypeError,  # type: ignore[arg-type]
         r"^ShardAwareKernels\(kernels='torch'\) is not allowed here: "
             r".*a kernel backend.*HINT: .*get_kernels"),
    ],
)  # fmt: skip
def test_consistency_check_rejects_bad_arguments(
    call: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


def test_the_norm_types_that_global_norm_takes() -> None:
    for p in (2.0, 1, 0, math.inf, -math.inf, 3.5):
        assert torch.equal(global_norm(torch.tensor(5.0), p), torch.tensor(5.0))
