"""Trainer.fit with half-precision weights: masters (O2), pure half (O3, "-true" + rounding), opt levels."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from amp_plugin import AMPPrecision
from amp_plugin.lightning import CHECKPOINT_KEY

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _data(n: int = 256, seed: int = 1) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g)).tanh()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2, eps: float = 1e-8, inject_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
        self.lr, self.eps, self.inject_at = lr, eps, inject_at
        self.losses: list[float] = []
        self.snapshots: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.global_step == self.inject_at:
            opt = self.trainer.optimizers[0]
            self.snapshots["before"] = _snapshot(self, opt)
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if "before" in self.snapshots and "after" not in self.snapshots:
            self.snapshots["after"] = _snapshot(self, self.trainer.optimizers[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=self.eps)


def _snapshot(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": [p.detach().clone() for p in module.parameters()],
        "optimizer_params": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }


def _fit(
    plugin: AMPPrecision, module: L.LightningModule, tmp_path: Path | None = None, **kw: Any
) -> L.Trainer:
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        **{"max_epochs": 4, "enable_checkpointing": False, **kw},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return trainer


def _tail(losses: list[float]) -> float:
    return sum(losses[-8:]) / 8  # the last epoch's mean


# ---------------------------------------------------------------- the weight-backup effect


class OneWeight(L.LightningModule):
    """A weight of 1.0 that gets an update of exactly lr = 1e-4 per step (fp16's spacing at 1 is ~1e-3)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w * batch[0].to(self.w.dtype)).float().sum()  # d loss / d w = 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


@pytest.mark.parametrize(("level", "expected"), [("O2", 1 - 40 * 1e-4), ("O3", 1.0), ("O1", 1 - 40 * 1e-4)])
def test_o2_keeps_updates_below_fp16_spacing_and_o3_loses_them(level: str, expected: float) -> None:
    module = OneWeight()
    ones = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(40, 4)), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", plugins=[AMPPrecision.from_opt_level(level)], max_steps=40,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ones)
    assert module.w.dtype == (torch.float32 if level == "O1" else torch.float16)
    assert module.w.float().mean().item() == pytest.approx(expected, abs=2e-4)


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
    reference = Regressor()
    _fit(AMPPrecision("32-true"), reference)
    module = Regressor()
    _fit(AMPPrecision(**kwargs), module)
    assert _tail(module.losses) == pytest.approx(_tail(reference.losses), rel=0.02)
    dtype = torch.float16 if kwargs["precision"].startswith("16") else torch.bfloat16
    assert module.net[0].weight.dtype == dtype
    norm_dtype = torch.float32 if kwargs.get("master_weights") else dtype
    assert module.net[1].weight.dtype == norm_dtype


def test_accumulation_and_clipping_with_master_weights_track_fp32() -> None:
    reference, module = Regressor(), Regressor()
    _fit(AMPPrecision("32-true"), reference, accumulate_grad_batches=2, gradient_clip_val=0.5)
    _fit(
        AMPPrecision("bf16-mixed", master_weights=True),
        module,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    assert _tail(module.losses) == pytest.approx(_tail(reference.losses), rel=0.02)


# ---------------------------------------------------------------- skips and checkpoints


@pytest.mark.parametrize(
    "kwargs",
    [{"precision": "16-mixed", "master_weights": True}, {"precision": "16-true", "rounding": "stochastic"}],
    ids=["O2", "16-true-stochastic"],
)
def test_a_skipped_step_leaves_model_masters_and_optimizer_state_bit_identical(
    kwargs: dict[str, Any],
) -> None:
    module = Regressor(eps=1e-4, inject_at=3)
    plugin = AMPPrecision(**kwargs)
    _fit(plugin, module, max_steps=5)
    before, after = module.snapshots["before"], module.snapshots["after"]
    assert plugin.driver.step_skipped(module.trainer.optimizers[0]) is False  # the later steps ran
    for key in ("model", "optimizer_params"):
        for a, b in zip(before[key], after[key], strict=True):
            assert torch.equal(a, b), key
    for index, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["state"][index][name]), (index, name)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def _fit_epochs(
    kwargs: dict[str, Any], epochs: int, tmp_path: Path | None = None, ckpt: Path | None = None
) -> tuple[Regressor, L.Trainer]:
    """Train ``Regressor`` for ``epochs``; with ``tmp_path`` a ModelCheckpoint writes ``last.ckpt`` there."""
    module = Regressor()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True)] if tmp_path else []
    trainer = L.Trainer(accelerator="cpu", plugins=[AMPPrecision(**kwargs)], max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_checkpointing=bool(tmp_path), callbacks=callbacks,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), ckpt_path=ckpt)
    return module, trainer


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-true", "rounding": "stochastic", "rounding_seed": 5},
        {"precision": "bf16-true", "rounding": "kahan"},
    ],
    ids=["O2", "bf16-true-stochastic", "bf16-true-kahan"],
)
def test_a_resume_continues_bit_exactly(kwargs: dict[str, Any], tmp_path: Path) -> None:
    uninterrupted, _ = _fit_epochs(kwargs, 2)
    _fit_epochs(kwargs, 1, tmp_path)
    resumed, trainer = _fit_epochs(kwargs, 2, ckpt=tmp_path / "last.ckpt")
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    if kwargs.get("master_weights"):
        ref = uninterrupted.trainer.precision_plugin.masters
        for a, b in zip(ref.masters(), trainer.precision_plugin.masters.masters(), strict=True):
            assert torch.equal(a, b)


def test_the_checkpoint_holds_the_fp32_master_weights(tmp_path: Path) -> None:
    _, trainer = _fit_epochs({"precision": "16-mixed", "master_weights": True}, 1, tmp_path)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AMPPrecision) and plugin.masters is not None
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    saved = checkpoint["state_dict"]["net.0.weight"]
    assert saved.dtype == torch.float32 and torch.equal(saved, next(plugin.masters.masters()))
    assert not torch.equal(saved, saved.half().float())  # really more than the fp16 weights hold
    assert checkpoint[CHECKPOINT_KEY]["precision"] == "16-mixed"
    fp32_model = Regressor()
    fp32_model.load_state_dict(checkpoint["state_dict"])  # an ordinary fp32 checkpoint


# ---------------------------------------------------------------- refusals


def test_fp16_true_refuses_an_eps_that_rounds_to_zero() -> None:
    with pytest.raises(
        ValueError, match=r"AdamW\(eps=1e-08\).*NaN.*6.1e-05.*HINT: build AdamW\(\.\.\., eps=1e-4\)"
    ):
        _fit(AMPPrecision("16-true"), Regressor(eps=1e-8), max_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"precision": "bf16-true", "master_weights": True},
            r"master_weights=True.*HINT: use precision='bf16-mixed'",
        ),
        (
            {"precision": "16-mixed", "rounding": "stochastic"},
            r"rounding='stochastic'.*HINT: use precision='bf16-true'",
        ),
        ({"precision": "32-true", "rounding": "kahan"}, r"rounding='kahan'"),
        ({"precision": "bf16-true", "rounding": "up"}, r"rounding='up'.*one of 'nearest'"),
        ({"precision": "16-mixed", "keep_fp32": (nn.LayerNorm,)}, r"keep_fp32=.*HINT: drop keep_fp32"),
        ({"precision": "16-mixed", "master_weights": "yes"}, r"master_weights='yes'.*a bool"),
        ({"precision": "bf16-true", "scaler": "LossScaler"}, r"scaler="),
        ({"precision": "bf16-true", "rounding_seed": -2}, r"rounding_seed=-2"),
    ],
)
def test_bad_half_weight_arguments_raise_with_a_hint(kwargs: dict[str, Any], match: str) -> None:
    if kwargs.get("scaler") == "LossScaler":
        from amp_plugin import LossScaler

        kwargs = {**kwargs, "scaler": LossScaler()}
    with pytest.raises((ValueError, TypeError), match=match):
        AMPPrecision(**kwargs)


# ---------------------------------------------------------------- Apex opt levels


@pytest.mark.parametrize(
    ("level", "precision", "master", "scale", "dynamic"),
    [
        ("O0", "32-true", False, None, None),
        ("O1", "16-mixed", False, 2.0**16, True),
        ("O2", "16-mixed", True, 2.0**16, True),
        ("O3", "16-true", False, 1.0, False),
    ],
)
def test_opt_levels_follow_apex(
    level: str, precision: str, master: bool, scale: float | None, dynamic: bool | None
) -> None:
    plugin = AMPPrecision.from_opt_level(level, device="cpu")
    assert (plugin.precision, plugin.master_weights) == (precision, master)
    if scale is None:
        assert plugin.scaler is None
    else:
        assert plugin.scaler is not None and plugin.scaler.get_scale() == scale
        assert plugin.scaler.state_dict()["dynamic"] is dynamic


def test_opt_level_overrides_use_apex_keywords() -> None:
    plugin = AMPPrecision.from_opt_level("O2", loss_scale=128.0, keep_batchnorm_fp32=False, device="cpu")
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 128.0
    model = plugin.convert_module(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert model[1].weight.dtype == torch.float16  # keep_batchnorm_fp32=False: the norm is cast too
    plugin = AMPPrecision.from_opt_level("O1", min_loss_scale=1.0, max_loss_scale=2.0**20)
    assert plugin.scaler is not None and plugin.scaler.state_dict()["max_scale"] == 2.0**20
    bf16 = AMPPrecision.from_opt_level("O3", cast_model_type=torch.bfloat16, rounding="stochastic")
    assert (bf16.requested, bf16.scaler, bf16.rounding) == ("bf16-true", None, "stochastic")


@pytest.mark.parametrize(
    ("level", "overrides", "match"),
    [
        ("O4", {}, r"level='O4'.*'O0', 'O1', 'O2', 'O3'.*HINT: use 'O1'"),
        ("o2", {}, r"HINT: use 'O2'"),
        ("02", {}, r"the letter O, not zero"),
        ("O1", {"master_weights": True}, r"master_weights=True.*HINT: use level 'O2'"),
        ("O2", {"loss_scale": "static"}, r"loss_scale='static'.*'dynamic' or a finite number"),
        ("O2", {"cast_model_type": torch.bfloat16, "loss_scale": 8.0}, r"no loss scaling with bf16"),
        ("O2", {"precision": "bf16-mixed"}, r"precision=\.\.\..*the level sets it"),
        ("O3", {"loss_scale": 1.0, "max_loss_scale": 4.0}, r"bounds only with loss_scale='dynamic'"),
        ("O2", {"cast_model_type": "half"}, r"cast_model_type='half'"),
    ],
)
def test_bad_opt_levels_and_overrides_raise(level: str, overrides: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        AMPPrecision.from_opt_level(level, **overrides)


@pytest.mark.parametrize("corrupt", ["master shape", "rounding state"])
def test_a_corrupt_half_weight_entry_is_refused_before_anything_changes(corrupt: str, tmp_path: Path) -> None:
    kwargs = {"precision": "bf16-true", "rounding": "stochastic"} if corrupt == "rounding state" else {
        "precision": "bf16-mixed", "master_weights": True}  # fmt: skip
    _, trainer = _fit_epochs(kwargs, 1, tmp_path)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    if corrupt == "master shape":
        checkpoint["state_dict"]["net.3.weight"] = torch.zeros(5)
    else:
        checkpoint[CHECKPOINT_KEY]["rounding"] = [{"generators": {"cpu": "not a state"}}]
    plugin = trainer.precision_plugin
    module = trainer.lightning_module
    before = [p.detach().clone() for p in module.parameters()]
    masters = [m.detach().clone() for m in plugin.masters.masters()] if plugin.masters else []
    scale = plugin.scaler.get_scale() if plugin.scaler else None
    with pytest.raises(ValueError, match=r"HINT"):
        plugin.check_checkpoint(checkpoint)
    with pytest.raises(ValueError, match=r"HINT"):
        plugin.on_load_checkpoint(checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    if plugin.masters:
        assert all(torch.equal(a, b) for a, b in zip(masters, plugin.masters.masters(), strict=True))
    assert (plugin.scaler.get_scale() if plugin.scaler else None) == scale


# ---------------------------------------------------------------- half models, weights-only, frozen


class HalfBoring(L.LightningModule):
    """A BoringModel-like module that is already fp16 (``model.half()``) when it reaches the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)).half()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)  # eps=1e-8: 0 in fp16


@pytest.mark.parametrize("plugin", ["O2", "16-mixed master_weights"])
def test_o2_on_a_half_model_trains_finite_weights_with_a_master_per_parameter(plugin: str) -> None:
    module = HalfBoring()
    amp = AMPPrecision.from_opt_level("O2")
    if plugin != "O2":
        amp = AMPPrecision("16-mixed", master_weights=True)
    _fit(amp, module, max_steps=4)
    trainable = [p for p in module.parameters() if p.requires_grad and p.dtype == torch.float16]
    assert amp.masters is not None and len(amp.masters) == len(trainable) == 4
    assert module.layer[1].weight.dtype == torch.float32  # the norm layer is fp32 again, as in Apex's O2
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _MastersAtFitStart(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.values = [m.detach().clone() for m in trainer.precision_plugin.masters.masters()]


def test_a_second_fit_with_a_new_o2_plugin_continues_from_the_fp32_masters() -> None:
    module = Regressor()
    first = AMPPrecision("16-mixed", master_weights=True)
    _fit(first, module, max_steps=3)
    assert first.masters is not None
    values = [m.detach().clone() for m in first.masters.masters()]
    assert any(not torch.equal(v, v.half().float()) for v in values)  # more than the fp16 model holds
    seen = _MastersAtFitStart()
    _fit(AMPPrecision("16-mixed", master_weights=True), module, max_steps=3, callbacks=[seen])
    assert all(torch.equal(a, b) for a, b in zip(values, seen.values, strict=True))
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _Unfreezes(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)  # frozen when the model is cast: no master

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.net[0].weight.requires_grad_(True)
        return super().configure_optimizers()


def test_o2_fit_start_refuses_a_trainable_half_parameter_without_a_master() -> None:
    with pytest.raises(ValueError, match=r"net.0.weight.*no fp32 master.*HINT"):
        _fit(AMPPrecision("16-mixed", master_weights=True), _Unfreezes(), max_steps=1)


@pytest.mark.parametrize("how", ["save_checkpoint", "ModelCheckpoint", "model.state_dict"])
def test_weights_only_checkpoints_hold_the_fp32_masters(how: str, tmp_path: Path) -> None:
    module = Regressor()
    plugin = AMPPrecision("16-mixed", master_weights=True)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_weights_only=True)]
    trainer = _fit(plugin, module, tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=callbacks)
    if how == "save_checkpoint":
        trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
        state = torch.load(tmp_path / "w.ckpt", weights_only=False)["state_dict"]
    elif how == "ModelCheckpoint":
        state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    else:
        state = module.state_dict()
    assert plugin.masters is not None
    master = next(plugin.masters.masters())
    assert state["net.0.weight"].dtype == torch.float32 and torch.equal(state["net.0.weight"], master)
    assert not torch.equal(master, master.half().float())


def test_the_rounding_state_is_saved_after_fit_and_a_resume_is_bit_exact(tmp_path: Path) -> None:
    kwargs = {"precision": "bf16-true", "rounding": "stochastic", "rounding_seed": 3}
    uninterrupted = Regressor()
    _fit(AMPPrecision(**kwargs), uninterrupted, max_epochs=2)
    first = Regressor()
    trainer = _fit(AMPPrecision(**kwargs), first, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")  # after teardown
    assert "rounding" in torch.load(tmp_path / "after_fit.ckpt", weights_only=False)[CHECKPOINT_KEY]
    resumed = Regressor()
    _fit(AMPPrecision(**kwargs), resumed, max_epochs=2, ckpt_path=tmp_path / "after_fit.ckpt")
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class LoRA(Regressor):
    """A frozen base layer with a trainable low-rank update, as in LoRA fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)
        self.net[0].bias.requires_grad_(False)
        self.down, self.up = nn.Linear(8, 2, bias=False), nn.Linear(2, 32, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[0](x) + self.up(self.down(x))
        out = self.net[3](self.net[2](self.net[1](hidden)))
        return nn.functional.mse_loss(out.float(), y.float())


def test_frozen_base_weights_are_held_and_saved_in_half_without_a_master(tmp_path: Path) -> None:
    module = LoRA()
    original = module.net[0].weight.detach().clone()
    plugin = AMPPrecision("16-mixed", master_weights=True)
    trainer = _fit(plugin, module, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    state = torch.load(tmp_path / "lora.ckpt", weights_only=False)["state_dict"]
    frozen = module.net[0].weight
    assert frozen.dtype == torch.float16 and torch.equal(frozen, original.half())  # rounded once, at the cast
    assert state["net.0.weight"].dtype == torch.float16 and torch.equal(state["net.0.weight"], frozen)
    assert state["up.weight"].dtype == torch.float32 and state["net.3.weight"].dtype == torch.float32
    assert plugin.masters is not None and len(plugin.masters) == 4  # up, down, net.3 weight and bias
    LoRA().load_state_dict(state)  # loads into the fp32 model


@pytest.mark.parametrize("where", ["configure_model", "init_module"])
def test_true_precision_layers_are_built_in_half_never_fp32(where: str) -> None:
    """Layers made in configure_model or under trainer.init_module() come out bf16 at once
    (no fp32 copy to convert later, the peak memory "-true" exists to save), as with Lightning's
    HalfPrecision; the default dtype is float32 again after fit."""
    seen: list[torch.dtype] = []

    class Late(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None

        def configure_model(self) -> None:
            if self.net is None:
                self.net = nn.Linear(4, 1)
                seen.append(self.net.weight.dtype)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            assert self.net is not None
            seen.append(torch.zeros(1).dtype)  # a tensor made in forward
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        plugins=[AMPPrecision("bf16-true")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if where == "init_module":
        with trainer.init_module():
            model = Late()
            model.net = nn.Linear(4, 1)
            seen.append(model.net.weight.dtype)
    else:
        model = Late()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer.fit(model, data)
    assert seen[0] == torch.bfloat16 and set(seen[1:]) == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
