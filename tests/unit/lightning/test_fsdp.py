"""AMPFSDPPrecision: what Lightning allows on CPU, and a real FSDP fit on CUDA.

Lightning's FSDPStrategy wraps the model in torch's FullyShardedDataParallel (FSDP1), which
refuses a CPU-only machine, and the Trainer refuses FSDP without a GPU accelerator. On CPU
the plugin's hooks run in 2 gloo processes where each rank's parameter stands for its
FSDP1 shard (a plain tensor holding different elements on each rank, as a flat parameter's
shard does), and are compared with Lightning's own FSDPPrecision.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from amp_plugin import AMPFSDPPrecision, LossScaler
from amp_plugin.spike import SpikeGuard
from tests._ranks import run_ranks

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = pytest.mark.slow

WORLD, POISON_STEP, CLIP = 2, 1, 0.1


def test_defaults_and_bad_arguments() -> None:
    plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
    assert isinstance(plugin, FSDPPrecision) and isinstance(plugin.scaler, LossScaler)
    assert AMPFSDPPrecision("bf16-mixed").scaler is None
    with pytest.raises(ValueError, match=r"precision='fp8'.*HINT"):
        AMPFSDPPrecision("fp8")
    with pytest.raises(TypeError, match=r"scaler=GradScaler.*HINT"):
        AMPFSDPPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only with '16-mixed'"):
        AMPFSDPPrecision("bf16-mixed", scaler=LossScaler("cpu"))
    assert isinstance(AMPFSDPPrecision("bf16-mixed").guard, LossScaler)  # bf16 is checked too
    with pytest.raises(ValueError, match=r"guard=False.*HINT"):
        AMPFSDPPrecision("bf16-mixed", guard=False).clip_grad_by_norm(
            torch.optim.SGD([nn.Parameter(torch.ones(1))]), 1.0
        )


def test_fsdp_strategy_takes_the_plugin_and_the_trainer_asks_for_a_gpu() -> None:
    plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
    strategy = FSDPStrategy(precision_plugin=plugin)
    assert strategy.precision_plugin is plugin  # the setter accepts FSDPPrecision subclasses only
    assert strategy.mixed_precision_config.param_dtype == torch.float16
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy(precision_plugin=plugin))


def _shard(rank: int) -> nn.Parameter:
    return nn.Parameter(torch.arange(4.0) / 8 + rank)  # different elements on each rank


def _step(
    plugin: FSDPPrecision, param: nn.Parameter, opt: torch.optim.Optimizer, rank: int, step: int,
    norms: list[float],
) -> Any:  # fmt: skip
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (param * param).sum() * 3.0
        plugin.scaler.scale(loss).backward()  # what the plugins' backward does (theirs in pre_backward)
        if rank == 1 and step == POISON_STEP:
            param.grad.view(-1)[0] = float("inf")  # rank 1's shard only
        return loss

    def after_closure(model: Any, optimizer: Any) -> None:  # what Lightning does there: hooks, then clip
        if isinstance(plugin, AMPFSDPPrecision):
            plugin.clip_grad_by_norm(optimizer, CLIP)
            norms.append(plugin.scaler.grad_norm(optimizer).item())  # this shard's, after the clip

    plugin._after_closure = after_closure  # type: ignore[method-assign]
    return plugin.optimizer_step(opt, SimpleNamespace(automatic_optimization=True), closure)  # type: ignore[arg-type]


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    results: dict[str, Any] = {}
    lightning = FSDPPrecision("16-mixed")  # its scaler= argument refuses every scaler (Lightning 2.6)
    lightning.scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    plugins = {
        "lightning": lightning,
        "amp_plugin": AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu", init_scale=1024.0)),
    }
    for name, plugin in plugins.items():
        param = _shard(rank)
        opt = torch.optim.AdamW([param], lr=0.1, fused=True)
        changed, norms = [], []
        for step in range(3):
            before = param.detach().clone()
            _step(plugin, param, opt, rank, step, norms)
            changed.append(not torch.equal(before, param.detach()))
        results[name] = {"stepped": changed, "finite": bool(torch.isfinite(param).all()),
                         "scale": plugin.scaler.get_scale(), "clipped_norms": norms}  # fmt: skip
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path_factory.mktemp("lightning_fsdp"), WORLD)


def test_lightning_plugin_with_a_fused_optimizer_lets_the_ranks_disagree(ranks: list[dict[str, Any]]) -> None:
    """The gap: ShardedGradScaler all-reduces in unscale_, which Lightning skips for fused optimizers."""
    assert [r["lightning"]["stepped"][POISON_STEP] for r in ranks] == [True, False]


def test_amp_fsdp_precision_makes_every_rank_skip_with_a_fused_optimizer(ranks: list[dict[str, Any]]) -> None:
    expected = [step != POISON_STEP for step in range(3)]
    assert [r["amp_plugin"]["stepped"] for r in ranks] == [expected, expected]
    assert all(r["amp_plugin"]["finite"] and r["amp_plugin"]["scale"] == 512.0 for r in ranks)


def test_clip_grad_by_norm_uses_the_norm_of_every_shard(ranks: list[dict[str, Any]]) -> None:
    """After the clip the shards together have norm CLIP (a per-rank norm would give each shard CLIP)."""
    for step in (0, 2):  # finite steps (the clip gradient norm is 6 * |p| > CLIP on each shard)
        whole = math.sqrt(sum(r["amp_plugin"]["clipped_norms"][step] ** 2 for r in ranks))
        assert whole == pytest.approx(CLIP, rel=1e-4)


@pytest.mark.parametrize(
    ("precision", "variant", "dtype"),
    # bf16-mixed runs with FSDP2's policy: fp32 shards and fp32 DTensor gradients, as without one.
    [("16-mixed", "", "float32"), ("bf16-mixed", "policy", "float32"),
     ("bf16-true", "castfirst", "bfloat16")],
)  # fmt: skip
def test_amp_precision_under_model_parallel_strategy_on_cpu(
    tmp_path: Path, precision: str, variant: str, dtype: str
) -> None:
    """Lightning's FSDP2 strategy runs on CPU; AMPPrecision handles its DTensor gradients.

    The two routes the refusal of casting sharded parameters points to (docs/distributed.md) run:
    fp32 shards with FSDP2's bf16 ``MixedPrecisionPolicy``, and a model cast before sharding.
    """
    script = Path(__file__).with_name("_model_parallel_fit.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), *sys.path])}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), precision, variant], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["param_type"] == "DTensor" and ranks[0]["param_dtype"] == f"torch.{dtype}"
    assert all(r["params_equal_across_ranks"] and r["params_finite"] for r in ranks)
    assert ranks[0]["norms"] == ranks[1]["norms"]  # the clip norm is the global one on both ranks
    if precision == "16-mixed":
        assert [(r["skipped"], r["scale"]) for r in ranks] == [(1, 512.0), (1, 512.0)]
        assert not math.isfinite(ranks[0]["norms"][2])  # rank 0's own shard was finite


def test_loss_scale_monitor_names_the_sharded_parameter_on_every_rank(tmp_path: Path) -> None:
    """FSDP2's DTensor gradients: the monitor's forensics run on every rank and name the parameter."""
    script = Path(__file__).with_name("_model_parallel_fit.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), *sys.path])}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "16-mixed", "monitor"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    named = "net.2.weight (inf in 1 of 48 values, float32)"  # in rank 1's shard only
    expected = [[named] if step == 2 else [] for step in range(5)]
    assert [r["forensics"] for r in ranks] == [expected, expected]
    assert [(r["skipped"], r["params_finite"]) for r in ranks] == [(1, True), (1, True)]
    # Rank zero's report, read after the norm clip, which leaves the gradients of an inf norm as they are.
    assert "Non-finite gradients: net.2.weight (inf in 1 of 48 values" in run.stdout + run.stderr


@pytest.mark.cuda
def test_fit_under_fsdp_strategy_on_cuda(tmp_path: Path) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    plugin = AMPFSDPPrecision("16-mixed")
    trainer = Trainer(
        accelerator="cuda", devices=1, strategy=FSDPStrategy(precision_plugin=plugin), max_steps=8,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    model = Model()
    try:
        trainer.fit(model)
    finally:  # Lightning's FSDP on one device leaves its process group behind, in this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert plugin.scaler.total_steps == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"precision": "64-true"}, "is not supported in FSDP"),
        ({"precision": "bf16-mixed", "scaler": "a scaler"}, "does not use a scaler"),
    ],
)
def test_argument_errors_say_what_lightnings_fsdp_precision_says_plus_a_hint(
    kwargs: dict[str, Any], words: str
) -> None:
    """A drop-in for FSDPPrecision: its messages' words (which tests and users match on) and ours' HINT."""
    with pytest.raises(ValueError, match=words):
        FSDPPrecision(**{**kwargs, "scaler": torch.amp.GradScaler("cpu") if "scaler" in kwargs else None})
    ours = {**kwargs, "scaler": LossScaler("cpu") if "scaler" in kwargs else None}
    with pytest.raises(ValueError, match=rf"{words}.*HINT"):
        AMPFSDPPrecision(**ours)


def test_fsdp_plugin_takes_the_run_keywords_it_can_act_on() -> None:
    """``guard``, ``kernels`` and ``spike_guard`` mean for AMPFSDPPrecision what they mean for
    AMPPrecision; they are keyword-only, as there."""
    spike = SpikeGuard()
    plugin = AMPFSDPPrecision("bf16-mixed", kernels="torch", spike_guard=spike)
    assert plugin.guard is not None and plugin.guard.spike_guard is spike and plugin.guard.get_scale() == 1.0
    scaled = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"), spike_guard=spike)
    assert scaled.guard is scaled.scaler and scaled.scaler is not None and scaled.scaler.spike_guard is spike
    with pytest.raises(ValueError, match=r"guard=False, spike_guard=SpikeGuard.*HINT"):
        AMPFSDPPrecision("bf16-mixed", guard=False, spike_guard=spike)
    with pytest.raises(ValueError, match=r"kernels='triton'.*HINT"):
        AMPFSDPPrecision("bf16-mixed", kernels="triton")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AMPFSDPPrecision("bf16-mixed", None, False)  # type: ignore[misc]


def _guarded_step(
    plugin: AMPFSDPPrecision, param: nn.Parameter, opt: torch.optim.Optimizer, value: float
) -> None:
    """One automatic-optimization step through the plugin's hooks, its gradient ``value`` everywhere."""

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (param * value).sum()
        plugin.backward(loss, LightningModule(), opt)  # scaled (seeded) by the guard, as in a fit
        return loss

    plugin._after_closure = lambda model, optimizer: None  # type: ignore[method-assign]  # no hooks here
    plugin.optimizer_step(opt, SimpleNamespace(automatic_optimization=True), closure)  # type: ignore[arg-type]


def test_a_skipped_step_holds_a_step_interval_scheduler_as_under_amp_precision() -> None:
    plugin = AMPFSDPPrecision("bf16-mixed", kernels="torch")
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    config = SimpleNamespace(scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), interval="step")
    _, _, (wrapped,) = plugin.connect(nn.Linear(1, 1), [opt], [config])
    lrs = []
    for value in (1.0, float("nan"), 1.0):
        _guarded_step(plugin, param, opt, value)
        wrapped.scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.5, 0.25]  # the skipped step moved neither the weights nor the LR
    assert plugin.last_step_skipped is False and plugin.guard is not None and plugin.guard.skipped_steps == 1
    advancing = AMPFSDPPrecision("bf16-mixed", lr_on_skip="advance")
    assert advancing.lr_on_skip == "advance"
    with pytest.raises(ValueError, match=r"lr_on_skip='keep'.*HINT"):
        AMPFSDPPrecision("bf16-mixed", lr_on_skip="keep")  # type: ignore[arg-type]


def test_the_guards_skip_counts_and_the_scale_resume_from_a_checkpoint() -> None:
    plugin = AMPFSDPPrecision("bf16-mixed", kernels="torch")
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    for value in (1.0, float("nan")):
        _guarded_step(plugin, param, opt, value)
    resumed = AMPFSDPPrecision("bf16-mixed", kernels="torch")
    resumed.load_state_dict(plugin.state_dict())  # what Lightning files under the class name
    assert resumed.guard is not None and (resumed.guard.skipped_steps, resumed.guard.total_steps) == (1, 2)

    scaled = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu", init_scale=8.0))
    back = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
    back.load_state_dict(scaled.state_dict())
    assert back.scaler is not None and back.scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match="HINT"):
        back.load_state_dict({"guard": "garbage", "scale": "x"})
    assert back.scaler.get_scale() == 8.0  # refused whole: nothing changed


def test_a_checkpoint_of_lightnings_fsdp_precision_resumes_its_scale() -> None:
    checkpoint = {"FSDPPrecision": torch.amp.GradScaler("cpu", init_scale=4.0).state_dict()}
    plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
    plugin.on_load_checkpoint(checkpoint)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 4.0
    ours = {"AMPFSDPPrecision": LossScaler("cpu", init_scale=2.0).state_dict(), **checkpoint}
    plugin.on_load_checkpoint(ours)  # its own entry, which Lightning loads next, wins: nothing read here
    assert plugin.scaler.get_scale() == 4.0


@pytest.mark.parametrize(
    ("ours", "fused"),
    [(True, False), (True, True), (False, True)],  # FSDPPrecision's non-fused unscale needs a process group
    ids=["AMPFSDPPrecision", "AMPFSDPPrecision-fused", "FSDPPrecision-fused"],
)
def test_value_clipping_clamps_unscaled_gradients_with_fused_optimizers_too(ours: bool, fused: bool) -> None:
    """A fused optimizer unscales inside its step, after the hooks: the clip unscales first all the same.

    Lightning's FSDPPrecision skips its unscale for such an optimizer and clamps the scaled gradients.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    plugin: FSDPPrecision
    if ours:
        plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu", init_scale=2.0**10))
    else:
        plugin = FSDPPrecision("16-mixed")  # its scaler= argument refuses every scaler (Lightning 2.6)
        plugin.scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=1.0, fused=fused)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (param * 3.0).sum()  # each gradient 3.0
        assert plugin.scaler is not None
        plugin.scaler.scale(loss).backward()
        return loss

    plugin._after_closure = lambda model, optimizer: plugin.clip_gradients(  # type: ignore[method-assign]
        optimizer, 0.5, GradClipAlgorithmType.VALUE
    )
    plugin.optimizer_step(opt, SimpleNamespace(automatic_optimization=True), closure)  # type: ignore[arg-type]
    clamped_scaled = fused and not ours
    assert param.tolist() == [-0.5 / 2**10 if clamped_scaled else -0.5] * 3  # clamped at 0.5 unscaled
