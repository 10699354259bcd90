"""Every object a user hands to Lightning survives a spawn: pickle round trips, a Fabric ``ddp_spawn`` run.

``Fabric(strategy="ddp_spawn")`` and ``Trainer(strategy="ddp_spawn")`` pickle the plugins and
callbacks into each new process; a plugin that does not pickle kills the run at launch.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from amp_plugin import AMPPrecision as TrainerAMPPrecision
from amp_plugin import LossScaler
from amp_plugin.lightning._fsdp import AMPFSDPPrecision
from amp_plugin.lightning._monitor import LossScaleMonitor
from amp_plugin.lightning.fabric import AMPPrecision
from tests._ranks import leave_group, skip_teardown_at_exit

pytestmark = pytest.mark.filterwarnings("ignore:.*emulates.*")

WORLD = 2
POISON_STEP = 1

HANDED_OVER: dict[str, Callable[[], Any]] = {
    "fabric 16-mixed": lambda: AMPPrecision("16-mixed", device="cpu"),
    "fabric bf16-mixed": lambda: AMPPrecision("bf16-mixed", device="cpu"),
    "fabric 32-true unguarded": lambda: AMPPrecision("32-true", device="cpu", guard=False),
    "fabric master weights": lambda: AMPPrecision("16-mixed", device="cpu", master_weights=True),
    "fabric bf16-true stochastic": lambda: AMPPrecision("bf16-true", device="cpu", rounding="stochastic"),
    "fabric fp32_modules": lambda: AMPPrecision("bf16-mixed", device="cpu", fp32_modules=[nn.LayerNorm]),
    "trainer 16-mixed": lambda: TrainerAMPPrecision("16-mixed", device="cpu"),
    "trainer auto": lambda: TrainerAMPPrecision(),
    "trainer master weights": lambda: TrainerAMPPrecision("16-mixed", device="cpu", master_weights=True),
    "trainer fp32_functions": lambda: TrainerAMPPrecision("bf16-mixed", fp32_functions=[torch.sigmoid]),
    "fsdp 16-mixed": lambda: AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu")),
    "fsdp bf16-mixed": lambda: AMPFSDPPrecision("bf16-mixed"),
    "loss scaler": lambda: LossScaler("cpu", init_scale=8.0, hysteresis=2),
    "monitor": lambda: LossScaleMonitor(trace_nonfinite=True),
}


def _round_trip(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("name", list(HANDED_OVER))
def test_what_a_user_hands_to_lightning_pickles(name: str) -> None:
    obj = HANDED_OVER[name]()
    copy = _round_trip(obj)
    assert type(copy) is type(obj)
    if isinstance(obj, (LossScaler, LossScaleMonitor)):
        assert copy.state_dict() == obj.state_dict()
    else:
        assert (copy.precision, type(copy.scaler), type(copy.guard)) == (
            obj.precision, type(obj.scaler), type(obj.guard)
        )  # fmt: skip


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def _steps(fabric: Fabric, model: Any, opt: Any, steps: int, poison: int | None = None) -> None:
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if step == poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_a_plugin_that_has_trained_pickles_with_its_scaler_state(precision: str) -> None:
    plugin = AMPPrecision(precision, device="cpu", fp32_modules=[nn.LayerNorm])  # type: ignore[arg-type]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    _steps(fabric, model, opt, 3, poison=POISON_STEP)
    copy = _round_trip(plugin)
    assert copy.state_dict().keys() == plugin.state_dict().keys()
    assert copy.guard is not None and plugin.guard is not None
    assert plugin.guard.skipped_steps >= 1  # the poisoned step, at least
    assert (copy.guard.get_scale(), copy.guard.skipped_steps) == (
        plugin.guard.get_scale(), plugin.guard.skipped_steps
    )  # fmt: skip


def test_a_trainer_plugin_and_monitor_that_have_fit_pickle(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    plugin = TrainerAMPPrecision("16-mixed", device="cpu", master_weights=True, fp32_modules=[nn.LayerNorm])
    monitor = LossScaleMonitor()
    trainer = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], callbacks=[monitor], max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    plugin_copy, monitor_copy = _round_trip((plugin, monitor))
    assert plugin_copy.scaler.get_scale() == plugin.scaler.get_scale()
    assert repr(monitor_copy.state_dict()) == repr(monitor.state_dict())  # repr: nan != nan


def _spawned(fabric: Fabric, out: str) -> None:
    plugin = fabric.strategy.precision
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    skipped = []
    gen = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(4):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        with fabric.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if step == POISON_STEP and fabric.global_rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")  # one rank only: both must skip
        opt.step()
        opt.zero_grad()
        skipped.append(plugin.last_step_skipped)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(fabric.world_size)]
    dist.all_gather(gathered, flat)
    result = {
        "plugin": type(plugin).__qualname__,
        "scale": plugin.scaler.get_scale(),
        "skipped": skipped,
        "equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
        "finite": bool(torch.isfinite(flat).all()),
    }
    Path(out, f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    leave_group()  # a rank leaving early can make gloo abort the other at exit, now and then
    # Kept alive past the return: freeing the DDP model here (its Reducer holds the last reference
    # to the gloo group) joins gloo's thread with the GIL held, while that thread may still be
    # freeing the all_gather's work, whose Python tensors need the GIL: a deadlock, seen in CI.
    _KEPT.append((model, opt))
    skip_teardown_at_exit()  # after Fabric hands rank 0's result back, the process exits as it is


_KEPT: list[Any] = []


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_fabric_ddp_spawn_trains_with_the_plugin(tmp_path: Path) -> None:
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=1024.0))
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp_spawn", plugins=[plugin])
    fabric.launch(_spawned, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [step == POISON_STEP for step in range(4)]
    for rank in ranks:
        assert rank["plugin"] == "AMPPrecision"
        assert rank["skipped"] == expected
        assert rank["scale"] == 512.0
        assert rank["equal_across_ranks"] and rank["finite"]
