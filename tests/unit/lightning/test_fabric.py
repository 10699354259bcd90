"""``amp_plugin.lightning.fabric.AMPPrecision`` in Lightning Fabric: skips, clipping, checkpoints, DDP."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from torch import nn

import amp_plugin
from amp_plugin import LossScaler
from amp_plugin.lightning.fabric import AMPPrecision
from tests._ranks import leave_group

pytestmark = pytest.mark.filterwarnings("ignore:.*emulates.*")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _fabric(plugin: Any, **kwargs: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin], **kwargs)


def _setup(plugin: Any, fused: bool = False, lr: float = 0.01) -> tuple[Fabric, Any, Any]:
    fabric = _fabric(plugin)
    model = _net()
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=lr, fused=fused))
    return fabric, model, opt


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)


def _train(
    fabric: Fabric,
    model: Any,
    opt: Any,
    steps: range,
    max_norm: float | None = None,
    poison: tuple[int, ...] = (),
) -> list[torch.Tensor]:
    norms = []
    for step in steps:
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if step in poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        if max_norm is not None:
            norms.append(fabric.clip_gradients(model, opt, max_norm=max_norm, error_if_nonfinite=False))
        opt.step()
        opt.zero_grad()
    return norms


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("fused", [False, True])
def test_an_overflowing_step_leaves_weights_and_optimizer_state_untouched(fused: bool) -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    fabric, model, opt = _setup(plugin, fused=fused)
    _train(fabric, model, opt, range(2))
    weights, state = _flat(model).clone(), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    scale = plugin.scaler.get_scale()
    _train(fabric, model, opt, range(2, 3), poison=(2,))
    assert plugin.last_step_skipped and plugin.scaler.skipped_steps == 1
    assert torch.equal(_flat(model), weights)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in state.items())  # the step counter too
    assert plugin.scaler.get_scale() == scale / 2
    _train(fabric, model, opt, range(3, 4))
    assert not plugin.last_step_skipped and not torch.equal(_flat(model), weights)


def test_clip_gradients_returns_and_applies_the_unscaled_norm() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=2.0**12))
    fabric, model, opt = _setup(plugin)
    x, y = _batch(0)
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        out = model.module(x.half())
    nn.functional.mse_loss(out.float(), y).backward()  # unscaled reference gradients
    ref = [p.grad.clone() for p in model.parameters()]
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref]))
    opt.zero_grad()
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    norm = fabric.clip_gradients(model, opt, max_norm=0.1)
    torch.testing.assert_close(norm, ref_norm)  # the norm before clipping, not scaled
    assert ref_norm > 0.1
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g * (0.1 / (ref_norm + 1e-6)))
    assert fabric.clip_gradients(model, opt, max_norm=0.1) <= 0.1 + 1e-5  # a second clip: still unscaled


def test_training_with_clipping_matches_fabrics_mixed_precision_bit_for_bit() -> None:
    ours = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", growth_interval=2))
    theirs = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", growth_interval=2))
    results = []
    for plugin in (ours, theirs):
        fabric, model, opt = _setup(plugin)
        norms = _train(fabric, model, opt, range(8), max_norm=0.5, poison=(3,))
        results.append((_flat(model), torch.stack(norms), plugin.scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])  # the overflowing step's inf included
    assert results[0][2] == results[1][2]


def test_fused_optimizers_are_clipped_where_fabrics_mixed_precision_refuses() -> None:
    fabric, model, opt = _setup(MixedPrecision("16-mixed", "cpu"), fused=True)
    fabric.backward(model(_batch(0)[0]).float().sum())
    with pytest.raises(NotImplementedError):
        fabric.clip_gradients(model, opt, max_norm=0.1)
    plain = AMPPrecision("16-mixed", device="cpu")
    fabric, model, opt = _setup(plain)
    norms = _train(fabric, model, opt, range(4), max_norm=0.1)
    fused = AMPPrecision("16-mixed", device="cpu")
    fabric, fused_model, fused_opt = _setup(fused, fused=True)
    fused_norms = _train(fabric, fused_model, fused_opt, range(4), max_norm=0.1)
    torch.testing.assert_close(torch.stack(fused_norms), torch.stack(norms))
    torch.testing.assert_close(_flat(fused_model), _flat(model))


def test_a_resume_through_fabric_save_and_load_continues_bit_exactly(tmp_path: Path) -> None:
    scaler = LossScaler("cpu", init_scale=2.0**20, growth_interval=3)
    fabric, model, opt = _setup(plugin := AMPPrecision("16-mixed", device="cpu", scaler=scaler))
    _train(fabric, model, opt, range(5), max_norm=1.0, poison=(1,))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": plugin})
    _train(fabric, model, opt, range(5, 10), max_norm=1.0, poison=(7,))
    straight, straight_state = _flat(model), plugin.state_dict()

    resumed = AMPPrecision("16-mixed", device="cpu")
    fabric, model, opt = _setup(resumed)
    fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": resumed})
    assert resumed.scaler.get_scale() != LossScaler().get_scale()  # the saved scale came back
    _train(fabric, model, opt, range(5, 10), max_norm=1.0, poison=(7,))
    assert torch.equal(_flat(model), straight)
    assert resumed.state_dict() == straight_state


@pytest.mark.parametrize(
    ("saved", "loaded", "match"),
    [
        ("16-mixed", "bf16-mixed", "holds a loss-scaler state, but this bf16 run has no scaler: ignored"),
        ("bf16-mixed", "16-mixed", "holds no loss-scaler state .* the scale starts afresh"),
    ],
)
def test_a_resume_in_another_precision_says_what_happened_to_the_scale(
    tmp_path: Path, saved: str, loaded: str, match: str
) -> None:
    # As the Trainer plugin does: the scale is dropped or starts afresh, and the user is told so.
    fabric, model, opt = _setup(plugin := AMPPrecision(saved, device="cpu"))  # type: ignore[arg-type]
    _train(fabric, model, opt, range(2))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": plugin})
    fabric, model, opt = _setup(resumed := AMPPrecision(loaded, device="cpu"))  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=match):
        fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": resumed})
    assert resumed.metrics()["amp/skipped_steps"] == 0.0
    _train(fabric, model, opt, range(2, 4))
    assert not resumed.last_step_skipped


def test_bf16_autocasts_without_a_scaler() -> None:
    plugin = AMPPrecision("bf16-mixed", device="cpu")
    fabric, model, opt = _setup(plugin)
    assert plugin.scaler is None and set(plugin.state_dict()) == {"guard"}  # no scale; the skip counts
    out = model(_batch(0)[0])  # Fabric hands outputs back in fp32 (convert_output)
    assert torch.equal(out, out.bfloat16().float())  # computed in bf16
    _train(fabric, model, opt, range(2), max_norm=1.0)
    assert not plugin.last_step_skipped


def test_a_torch_grad_scaler_is_converted_with_its_settings() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    assert isinstance(plugin.scaler, LossScaler) and plugin.scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "fp16"}, ValueError, "HINT"),
        ({"precision": "16"}, ValueError, r"precision='16'.*'16-true', 'bf16-true'.*HINT"),
        ({"precision": "bf16-mixed", "scaler": LossScaler()}, ValueError, "HINT: drop scaler="),
        ({"precision": "16-mixed", "scaler": object()}, TypeError, "HINT"),
        ({"precision": "16-mixed", "device": "tpu"}, ValueError, "HINT"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AMPPrecision(**kwargs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lbfgs_without_a_loss_scaler_steps_with_its_closure(precision: str) -> None:
    # The fp16 refusal's HINT says bf16-mixed: there LBFGS steps (unguarded, with a warning), as
    # under Fabric's own plugins.
    def run(plugin: Any) -> nn.Module:
        fabric = _fabric(plugin)
        model = _net()
        model, opt = fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3))
        x, y = _batch(0)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            return loss

        for _ in range(2):
            opt.step(closure)
        return model

    reference = MixedPrecision("bf16-mixed", "cpu") if precision == "bf16-mixed" else Precision()
    oracle = run(reference)
    with pytest.warns(UserWarning, match=r"LBFGS.*not checked"):
        ours = run(AMPPrecision(precision, device="cpu"))  # type: ignore[arg-type]
    assert torch.equal(_flat(ours), _flat(oracle))
    assert not torch.equal(_flat(ours), _flat(_net()))


def test_lbfgs_is_refused_under_loss_scaling() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    fabric = _fabric(plugin)
    model = _net()
    model, opt = fabric.setup(model, torch.optim.LBFGS(model.parameters()))
    fabric.backward(model(_batch(0)[0]).float().sum())
    with pytest.raises(TypeError, match=r"LBFGS.*HINT"):
        opt.step(lambda: 0.0)


def _ddp_worker(fabric: Fabric, out_dir: str) -> None:
    plugin = fabric.strategy.precision
    model = _net()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = fabric.global_rank
    for step in range(4):
        x, y = _batch(10 * rank + step)
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if rank == 1 and step == 2:  # after DDP's all-reduce: only rank 1 sees the inf
            next(model.parameters()).grad[0, 0] = float("inf")
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
    flat = _flat(model)
    gathered = [torch.zeros_like(flat) for _ in range(fabric.world_size)]
    dist.all_gather(gathered, flat)
    equal, finite = all(torch.equal(gathered[0], g) for g in gathered), bool(torch.isfinite(flat).all())
    result = {"skipped": plugin.guard.skipped_steps, "equal": equal, "finite": finite}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    leave_group()
    # Kept alive to the forked worker's os._exit: freeing a DDP model after its group is gone can
    # deadlock in gloo's teardown now and then.
    _KEPT.append((model, opt))


_KEPT: list[Any] = []


@pytest.mark.forks
@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed"},
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-true", "rounding": "stochastic"},
    ],
    ids=lambda kwargs: "-".join(str(v) for v in kwargs.values()),
)
def test_ddp_ranks_agree_on_a_skip(kwargs: dict[str, Any], tmp_path: Path) -> None:
    """Half weights too: the masters and the stochastic rounding (one seed) stay equal across ranks."""
    plugin = AMPPrecision(**kwargs, device="cpu")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[plugin])
    fabric.launch(_ddp_worker, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results == [{"skipped": 1, "equal": True, "finite": True}] * 2


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("how", ["nan_loss", "inf_grad"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_every_precision_is_guarded(precision: str, how: str, fused: bool) -> None:
    """bf16 used to step on an inf gradient (no scaler, so no check): weights went non-finite for good."""
    scaler = LossScaler(init_scale=2.0**8) if precision == "16-mixed" else None
    plugin = AMPPrecision(precision, device="cpu", scaler=scaler)
    fabric, model, opt = _setup(plugin, fused=fused)
    _train(fabric, model, opt, range(2))
    weights, state = _flat(model).clone(), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    x, y = _batch(2)
    loss = nn.functional.mse_loss(model(x).float(), y)
    fabric.backward(loss + float("nan") if how == "nan_loss" else loss)
    if how == "inf_grad":
        next(model.parameters()).grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert plugin.last_step_skipped and plugin.guard is not None and plugin.guard.skipped_steps == 1
    assert torch.equal(_flat(model), weights)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in state.items())
    _train(fabric, model, opt, range(3, 4))
    assert not plugin.last_step_skipped and not torch.equal(_flat(model), weights)
    assert bool(torch.isfinite(_flat(model)).all())


def test_guard_false_leaves_bf16_unguarded() -> None:
    plugin = AMPPrecision("bf16-mixed", device="cpu", guard=False)
    assert plugin.guard is None
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, range(1), poison=(0,))
    assert not bool(torch.isfinite(_flat(model)).all())


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)]
)
def test_fabrics_throughput_utilities_read_the_right_dtype(precision: str, dtype: torch.dtype) -> None:
    """Fabric's own MixedPrecision set-up runs, so its utilities find what they read (no GradScaler built)."""
    from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype

    plugin = AMPPrecision(precision, device="cpu")
    assert _plugin_to_compute_dtype(plugin) == dtype
    assert plugin.scaler is None or isinstance(plugin.scaler, LossScaler)
    assert plugin.convert_input(torch.ones(2)).dtype == dtype


# -- "-true": the default dtype, as in Lightning's HalfPrecision -----------------------------------


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_precisions_switch_the_default_dtype_as_halfprecision_does(
    precision: str, dtype: torch.dtype
) -> None:
    from lightning.fabric.plugins.precision import HalfPrecision

    ours, theirs = AMPPrecision(precision, device="cpu"), HalfPrecision(precision)  # type: ignore[arg-type]
    for plugin in (ours, theirs):
        for context in (plugin.module_init_context, plugin.tensor_init_context, plugin.forward_context):
            with context():
                assert nn.Linear(2, 2).weight.dtype == dtype, (plugin, context)
                assert torch.ones(2).dtype == dtype and torch.get_default_dtype() == dtype
            assert torch.get_default_dtype() == torch.float32  # restored
    fabric = _fabric(ours)
    with fabric.init_module():
        model = nn.Linear(8, 1)
    assert model.weight.dtype == dtype  # made in half: no fp32 copy at its peak
    model = fabric.setup(model)
    assert model(torch.randn(2, 8)).dtype == torch.float32  # Fabric hands outputs back in fp32


@pytest.mark.parametrize("context", ["module_init_context", "tensor_init_context", "forward_context"])
def test_the_default_dtype_is_restored_after_an_error_and_when_nested(context: str) -> None:
    # Lightning's own test_default_dtype_is_restored, for this plugin; and nested in each other.
    plugin = AMPPrecision("bf16-true", device="cpu")
    seen: list[torch.dtype] = []

    def fails_inside() -> None:
        with getattr(plugin, context)():
            seen.append(torch.get_default_dtype())
            raise KeyError

    with pytest.raises(KeyError):
        fails_inside()
    assert seen == [torch.bfloat16] and torch.get_default_dtype() == torch.float32
    with plugin.module_init_context(), getattr(plugin, context)():
        pass
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_other_precisions_leave_the_default_dtype_alone(precision: str) -> None:
    plugin = AMPPrecision(precision, device="cpu")
    for context in (plugin.module_init_context, plugin.tensor_init_context, plugin.forward_context):
        with context():
            assert torch.get_default_dtype() == nn.Linear(2, 2).weight.dtype == torch.float32


def test_master_weights_are_made_from_fp32_values_under_init_module() -> None:
    plugin = AMPPrecision("bf16-mixed", master_weights=True, device="cpu")
    with _fabric(plugin).init_module():
        assert nn.Linear(2, 2).weight.dtype == torch.float32  # cast (and copied to the masters) at setup


# -- what a Fabric user logs: precision.metrics() ----------------------------------------------------


def test_metrics_report_scale_skips_and_rate_for_fabric_log_dict() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=2.0**10))
    fabric, model, opt = _setup(plugin)
    assert plugin.metrics() == {"amp/scale": 1024.0, "amp/skipped_steps": 0.0, "amp/skip_rate": 0.0}
    norms = _train(fabric, model, opt, range(4), max_norm=1.0, poison=(1,))
    metrics = plugin.metrics(grad_norm=norms[-1])
    expected = {"amp/scale": 512.0, "amp/skipped_steps": 1.0, "amp/skip_rate": 0.25}
    assert metrics == {**expected, "amp/grad_norm": norms[-1].item()}
    assert all(type(v) is float for v in metrics.values())
    logged: list[dict[str, Any]] = []

    class Logger:  # what fabric.log_dict hands each logger
        name, version = "probe", 0

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            logged.append(metrics)

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin], loggers=[Logger()])
    fabric.log_dict(plugin.metrics(), step=4)
    assert logged == [expected]


def test_bf16_metrics_count_the_guards_skips_and_have_no_scale() -> None:
    plugin = AMPPrecision("bf16-mixed", device="cpu")
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, range(2), poison=(0,))
    assert plugin.metrics() == {"amp/skipped_steps": 1.0, "amp/skip_rate": 0.5}
    # The NaN norm clip_gradients returns on a step with a NaN gradient is logged, not left out.
    nan_norm = plugin.metrics(grad_norm=torch.tensor(float("nan")))
    assert set(nan_norm) == {"amp/skipped_steps", "amp/skip_rate", "amp/grad_norm"}
    assert math.isnan(nan_norm["amp/grad_norm"])
    with pytest.raises(ValueError, match=r"grad_norm=Tensor of shape \(3,\).*HINT"):
        plugin.metrics(grad_norm=torch.ones(3))
    assert AMPPrecision("bf16-mixed", device="cpu", guard=False).metrics() == {}


# -- lr_on_skip: precision.skip_aware(scheduler) ----------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_a_skip_aware_scheduler_holds_on_a_skipped_step(fused: bool) -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=2.0**8))
    fabric, model, opt = _setup(plugin, fused=fused, lr=1.0)
    scheduler = plugin.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for step in range(4):
            _train(fabric, model, opt, range(step, step + 1), poison=(1,))
            if fused and step == 1:
                plugin.guard.skipped_steps  # noqa: B018  # a fused step's skip is known once read
            scheduler.step()
    assert plugin.guard.skipped_steps == 1
    assert scheduler.get_last_lr() == [0.5**3]  # 4 steps, one skipped
    assert scheduler.state_dict() == scheduler._scheduler.state_dict()  # checkpoints see the real one


def test_lr_on_skip_advance_steps_the_scheduler_without_the_order_warning() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", lr_on_skip="advance")
    fabric, model, opt = _setup(plugin, lr=1.0)
    scheduler = plugin.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(fabric, model, opt, range(1), poison=(0,))  # the very first step skipped
        scheduler.step()
    assert plugin.last_step_skipped and scheduler.get_last_lr() == [0.5]


# -- the two AMPPrecision classes, each in the other's place ----------------------------------------


def test_the_trainers_plugin_in_fabric_fails_at_setup_naming_the_fabric_import() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[amp_plugin.AMPPrecision("16-mixed", device="cpu")])
    hint = r"the Trainer's plugin.*HINT: from amp_plugin\.lightning\.fabric import "
    with pytest.raises(TypeError, match=hint):
        fabric.setup(_net())


def test_fabrics_plugin_in_a_trainer_is_refused_naming_the_trainer_import() -> None:
    from lightning.pytorch import Trainer

    with pytest.raises(
        Exception, match=r"amp_plugin\.lightning\.fabric\.AMPPrecision.*Trainer.* amp_plugin\.AMPPrecision"
    ):
        Trainer(accelerator="cpu", plugins=[AMPPrecision("16-mixed", device="cpu")], logger=False)


def test_fp32_modules_run_in_fp32_in_every_model_set_up() -> None:
    # A GAN sets up two models with one plugin: the second one's fp32 modules were left under autocast.
    plugin = AMPPrecision("bf16-mixed", device="cpu", fp32_modules=(nn.LayerNorm,))
    fabric = _fabric(plugin)
    models = [fabric.setup(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))) for _ in range(2)]
    seen: list[torch.dtype] = []
    for model in models:
        model.module[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        model(torch.randn(2, 4))
    assert seen == [torch.float32, torch.float32]
    plugin.teardown()
    assert not any(m._forward_pre_hooks for model in models for m in model.modules())


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_each_optimizer_is_checked_against_the_model_it_steps(precision: str) -> None:
    # A GAN sets up two models: the first one's optimizer was checked against the second model
    # and warned that its parameters were "not in the model".
    fabric = _fabric(AMPPrecision(precision, device="cpu"))  # type: ignore[arg-type]
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    (g, opt_g), (d, opt_d) = (fabric.setup(m, torch.optim.Adam(m.parameters(), eps=1e-4)) for m in (g, d))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not in the model")
        for _ in range(2):
            z = torch.randn(2, 4)
            fabric.backward(d(g(z).detach()).float().mean())
            opt_d.step()
            opt_d.zero_grad()
            fabric.backward(-d(g(z)).float().mean())
            opt_g.step()
            opt_g.zero_grad()


@pytest.mark.parametrize("bad", ["x", True, [1.0]])
def test_metrics_refuses_a_grad_norm_that_is_not_a_number(bad: object) -> None:
    with pytest.raises(TypeError, match=r"metrics\(grad_norm=.*HINT"):
        AMPPrecision("bf16-mixed", device="cpu").metrics(grad_norm=bad)  # type: ignore[arg-type]
