"""Fabric with half-precision weights: masters (O2), "-true" with a rounding, skips and resumes.

The Trainer's versions are in ``test_half_weights.py``; these run the same checks through
``amp_plugin.lightning.fabric.AMPPrecision`` in a plain Fabric loop.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from amp_plugin.lightning.fabric import AMPPrecision

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))


def _batches(n: int = 256, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g)).tanh()
    return list(zip(x.split(32), y.split(32), strict=True))


def _setup(
    plugin: AMPPrecision, lr: float = 1e-2, eps: float = 1e-8, fused: bool = False
) -> tuple[Fabric, Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _net()
    return (fabric, *fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, fused=fused)))


def _train(
    fabric: Fabric, model: Any, opt: Any, epochs: int, clip: float | None = None, poison: int | None = None
) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(_batches() * epochs):
        loss = nn.functional.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        fabric.backward(loss + float("nan") if step == poison else loss)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
    return losses


def _tail(losses: list[float]) -> float:
    return sum(losses[-8:]) / 8  # the last epoch's mean


def _snapshot(model: Any, opt: Any) -> dict[str, Any]:
    return {
        "model": [p.detach().clone() for p in model.parameters()],
        "optimizer_params": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("model", "optimizer_params"):
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), key
    for index, state in a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["state"][index][name]), (index, name)


# ---------------------------------------------------------------- the weight-backup effect


@pytest.mark.parametrize(
    ("kwargs", "dtype", "expected"),
    [
        ({"precision": "16-mixed", "master_weights": True}, torch.float16, 1 - 40 * 1e-4),
        ({"precision": "16-true"}, torch.float16, 1.0),
        ({"precision": "16-mixed"}, torch.float32, 1 - 40 * 1e-4),
    ],
    ids=["O2", "16-true", "O1"],
)
def test_o2_keeps_updates_below_fp16_spacing_and_16_true_loses_them(
    kwargs: dict[str, Any], dtype: torch.dtype, expected: float
) -> None:
    """Each update is lr = 1e-4, below fp16's spacing at 1.0 (~1e-3): only an fp32 copy keeps them."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AMPPrecision(**kwargs, device="cpu")])
    w = nn.Parameter(torch.ones(4))
    holder = nn.Module()
    holder.w = w
    model, opt = fabric.setup(holder, torch.optim.SGD(holder.parameters(), lr=1e-4))
    for _ in range(40):
        fabric.backward((model.w * torch.ones(4, dtype=model.w.dtype)).float().sum())  # d loss / d w = 1
        opt.step()
        opt.zero_grad()
    assert model.w.dtype == dtype
    assert model.w.float().mean().item() == pytest.approx(expected, abs=2e-4)


OPT_LEVELS = [
    ("O0", "32-true", False, None),
    ("O1", "16-mixed", False, 2.0**16),
    ("O2", "16-mixed", True, 2.0**16),
    ("O3", "16-true", False, 1.0),
]


@pytest.mark.parametrize(("level", "precision", "master", "scale"), OPT_LEVELS)
def test_apex_opt_levels_as_in_the_trainer(
    level: str, precision: str, master: bool, scale: float | None
) -> None:
    plugin = AMPPrecision.from_opt_level(level, device="cpu")  # type: ignore[arg-type]
    assert (plugin.precision, plugin.master_weights) == (precision, master)
    assert (None if plugin.scaler is None else plugin.scaler.get_scale()) == scale
    bf16 = AMPPrecision.from_opt_level("O2", cast_model_type=torch.bfloat16, device="cpu")
    assert (bf16.precision, bf16.master_weights, bf16.scaler) == ("bf16-mixed", True, None)
    with pytest.raises(ValueError, match=r"level='O4'.*HINT"):
        AMPPrecision.from_opt_level("O4")  # type: ignore[arg-type]


# ---------------------------------------------------------------- quality against fp32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-mixed", "master_weights": True},
        {"precision": "bf16-true", "rounding": "stochastic"},
        {"precision": "bf16-true", "rounding": "kahan"},
    ],
    ids=["O2-fp16", "O2-bf16", "bf16-true-stochastic", "bf16-true-kahan"],
)
def test_half_weight_training_reaches_fp32_loss_within_2_percent(kwargs: dict[str, Any]) -> None:
    reference = _train(*_setup(AMPPrecision("32-true", device="cpu")), epochs=4, clip=1.0)
    fabric, model, opt = _setup(AMPPrecision(**kwargs, device="cpu"))
    losses = _train(fabric, model, opt, epochs=4, clip=1.0)
    assert _tail(losses) == pytest.approx(_tail(reference), rel=0.02)
    dtype = torch.float16 if kwargs["precision"].startswith("16") else torch.bfloat16
    assert model.module[0].weight.dtype == dtype
    norm_dtype = torch.float32 if kwargs.get("master_weights") else dtype
    assert model.module[1].weight.dtype == norm_dtype
    if kwargs.get("master_weights"):  # the optimizer steps fp32 copies
        assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])


# ---------------------------------------------------------------- skips and checkpoints


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-mixed", "master_weights": True},
        {"precision": "16-true"},
        {"precision": "16-true", "rounding": "stochastic"},
        {"precision": "bf16-true"},
        {"precision": "bf16-true", "rounding": "stochastic"},
        {"precision": "bf16-true", "rounding": "kahan"},
        {"precision": "32-true"},
    ],
    ids=lambda kwargs: "-".join(str(v) for v in kwargs.values()),
)
def test_a_nan_step_leaves_model_masters_and_optimizer_state_bit_identical(kwargs: dict[str, Any]) -> None:
    _check_a_nan_step(AMPPrecision(**kwargs, device="cpu"), fused=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-mixed", "master_weights": True},
        {"precision": "bf16-true"},
    ],
    ids=lambda kwargs: "-".join(str(v) for v in kwargs.values()),
)
def test_a_nan_step_of_a_fused_optimizer_leaves_everything_bit_identical(kwargs: dict[str, Any]) -> None:
    """The fused step skips inside its kernel: no host read decides it."""
    _check_a_nan_step(AMPPrecision(**kwargs, device="cpu"), fused=True)


def _check_a_nan_step(plugin: AMPPrecision, fused: bool) -> None:
    assert plugin.guard is not None
    fabric, model, opt = _setup(plugin, eps=1e-4, fused=fused)
    batches = _batches()
    for step, (x, y) in enumerate(batches[:5]):
        if step == 3:
            before, skipped = _snapshot(model, opt), plugin.guard.skipped_steps
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss + float("nan") if step == 3 else loss)
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
        if step == 3:
            assert plugin.last_step_skipped and plugin.guard.skipped_steps == skipped + 1
            _assert_same(before, _snapshot(model, opt))
    assert not plugin.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(_snapshot(model, opt)["model"][0], before["model"][0])  # later steps moved


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-true", "rounding": "stochastic", "rounding_seed": 5},
        {"precision": "bf16-true", "rounding": "kahan"},
    ],
    ids=["O2", "bf16-true-stochastic", "bf16-true-kahan"],
)
def test_a_resume_through_fabric_save_and_load_continues_bit_exactly(
    kwargs: dict[str, Any], tmp_path: Path
) -> None:
    plugin = AMPPrecision(**kwargs, device="cpu")
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, epochs=1, poison=2)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": plugin})
    _train(fabric, model, opt, epochs=1, poison=5)
    straight = _snapshot(model, opt)

    resumed = AMPPrecision(**kwargs, device="cpu")
    fabric, model, opt = _setup(resumed)
    resumed.attach(opt)  # before the optimizer state is loaded: its fp32 state goes to the masters
    fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": resumed})
    _train(fabric, model, opt, epochs=1, poison=5)
    _assert_same(straight, _snapshot(model, opt))
    assert resumed.guard is not None and resumed.guard.skipped_steps == 2  # the skip counts resumed too


def test_the_checkpoint_holds_the_fp32_master_weights(tmp_path: Path) -> None:
    plugin = AMPPrecision("16-mixed", master_weights=True, device="cpu")
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, epochs=1)
    fabric.save(tmp_path / "ckpt.pt", {"model": model})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]["0.weight"]
    assert plugin.masters is not None
    assert saved.dtype == torch.float32 and torch.equal(saved, next(plugin.masters.masters()))
    assert not torch.equal(saved, saved.half().float())  # really more than the fp16 weights hold
    _net().load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"])  # plain fp32


def test_optimizer_state_loaded_before_the_masters_are_attached_is_refused(tmp_path: Path) -> None:
    plugin = AMPPrecision("16-mixed", master_weights=True, device="cpu")
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, epochs=1)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": plugin})
    resumed = AMPPrecision("16-mixed", master_weights=True, device="cpu")
    fabric, model, opt = _setup(resumed)
    fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "amp": resumed})
    before = _snapshot(model, opt)
    fabric.backward(model(_batches()[0][0]).float().sum())
    with pytest.raises(RuntimeError, match=r"AdamW.*state.*HINT: call precision\.attach\(optimizer\)"):
        opt.step()
    _assert_same(before, _snapshot(model, opt))


def test_16_true_refuses_an_eps_that_rounds_to_zero_before_the_first_step() -> None:
    fabric, model, opt = _setup(AMPPrecision("16-true", device="cpu"), eps=1e-8)
    before = _snapshot(model, opt)
    fabric.backward(model(_batches()[0][0]).float().sum())
    with pytest.raises(
        ValueError, match=r"AdamW\(eps=1e-08\).*NaN.*6.1e-05.*HINT: build AdamW\(\.\.\., eps=1e-4\)"
    ):
        opt.step()
    _assert_same(before, _snapshot(model, opt))


def test_training_continues_from_the_masters_after_teardown() -> None:
    plugin = AMPPrecision("bf16-mixed", master_weights=True, device="cpu")
    fabric, model, opt = _setup(plugin)
    _train(fabric, model, opt, epochs=1)
    masters = [m.detach().clone() for m in plugin.masters.masters()]
    plugin.teardown()  # what fabric.strategy.teardown() calls: the optimizer holds the half weights again
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.bfloat16, torch.float32}
    fabric.backward(model(_batches()[0][0]).float().pow(2).mean())
    opt.step()  # attached again: its fp32 state goes back to the masters, which step on
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert not torch.equal(next(plugin.masters.masters()), masters[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16-true", "master_weights": True}, r"master_weights=True.*HINT: .*'bf16-mixed'"),
        ({"precision": "16-mixed", "rounding": "stochastic"}, r"rounding='stochastic'.*HINT: .*'bf16-true'"),
        ({"precision": "bf16-true", "rounding": "up"}, r"rounding='up'.*one of 'nearest'"),
        ({"precision": "16-mixed", "keep_fp32": (nn.LayerNorm,)}, r"keep_fp32=.*HINT: drop keep_fp32"),
        ({"precision": "bf16-true", "rounding_seed": -2}, r"rounding_seed=-2"),
        ({"precision": "bf16-true", "lr_on_skip": "later"}, r"lr_on_skip='later'.*HINT"),
    ],
)
def test_bad_half_weight_arguments_raise_with_a_hint(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        AMPPrecision(**kwargs, device="cpu")


def test_a_second_model_under_master_weights_is_refused_before_it_is_cast() -> None:
    # The masters belong to one model: a second fabric.setup (a GAN's discriminator) used to pass,
    # then fail at its first step blaming requires_grad. Refused at once, the model left as it was.
    plugin = AMPPrecision("bf16-mixed", master_weights=True, device="cpu")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    generator, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"second model.*HINT: set up the models as one module"):
        fabric.setup(critic, torch.optim.SGD(critic.parameters(), lr=0.1))
    assert critic.weight.dtype == torch.float32
    fabric.setup(generator)  # the same model again is fine
