"""AMPPrecision never applies a non-finite step: unstepped batches, hooks after unscaling, manual loops."""

from __future__ import annotations

from typing import Any, ClassVar
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler


def _loader(batches: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batches * 4, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _fit(module: LightningModule, plugin: Any, batches: int = 4, **trainer_kwargs: Any) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=batches, plugins=[plugin],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, _loader(batches))
    return trainer


def _plugin(scale: float = 2.0**8) -> AMPPrecision:
    return AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=scale, growth_interval=1000))


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


class _Auto(LightningModule):
    """Returns None from training_step at ``none_at``; writes inf into a gradient at ``poison_at``."""

    def __init__(self, none_at: tuple[int, ...] = (), poison_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.none_at, self.poison_at = none_at, poison_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if batch_idx in self.none_at:
            return None
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.batch_idx in self.poison_at:
            self.net[2].weight.grad[0, 3] = float("inf")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- 1. training_step returned None ---------------------------------------------------------------


@pytest.mark.parametrize("none_at", [(0,), (1,)])
def test_an_unstepped_batch_leaves_no_stale_flag_behind(none_at: tuple[int, ...]) -> None:
    """Clipping ran on the empty batch and left 'no overflow' behind; the next overflow was applied."""
    module, plugin = _Auto(none_at=none_at, poison_at=(2,)), _plugin()
    _fit(module, plugin, gradient_clip_val=1.0)
    assert plugin.scaler is not None
    assert _finite(module)
    assert plugin.scaler.skipped_steps == 1 and plugin.scaler.get_scale() == 2.0**7


@pytest.mark.parametrize("clip", [1.0, 50.0])
def test_an_unstepped_batch_matches_lightning_mixed_precision(clip: float) -> None:
    """The clean step after it clipped the still-scaled gradients as if they were unscaled."""
    ours, ref = _Auto(none_at=(1,), poison_at=(3,)), _Auto(none_at=(1,), poison_at=(3,))
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    _fit(ref, MixedPrecision("16-mixed", "cpu", scaler=ref_scaler), gradient_clip_val=clip)
    plugin = _plugin()
    _fit(ours, plugin, gradient_clip_val=clip)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == ref_scaler.get_scale()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# -- 2. inf/NaN written after unscaling, by a hook that observes the gradients ----------------------


class _NanHook(_Auto):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.fit_loop.batch_idx == 1:
            self.net[0].weight.grad[0, 0] = float("nan")


class _NanCallback(Callback):
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if trainer.fit_loop.batch_idx == 1:
            pl_module.net[2].bias.grad.fill_(float("nan"))


@pytest.mark.parametrize(
    "clip", [{}, {"gradient_clip_val": 1.0}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}]
)
@pytest.mark.parametrize("source", ["module", "callback"])
def test_nan_written_by_a_hook_after_unscaling_is_skipped(clip: dict[str, Any], source: str) -> None:
    module = _NanHook() if source == "module" else _Auto()
    plugin = _plugin()
    callbacks = [] if source == "module" else [_NanCallback()]
    _fit(module, plugin, callbacks=callbacks, **clip)
    assert plugin.scaler is not None
    assert _finite(module)
    assert plugin.scaler.skipped_steps == 1 and plugin.scaler.get_scale() == 2.0**7


class _InfHook(_Auto):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.fit_loop.batch_idx == 1:
            self.net[0].weight.grad[0, 0] = float("inf")


def test_an_inf_written_by_a_hook_is_found_before_value_clipping_clamps_it() -> None:
    """The clamp would turn the inf into clip_value and hide it: the check runs before it."""
    module, plugin = _InfHook(), _plugin()
    _fit(module, plugin, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    assert plugin.scaler is not None
    assert plugin.scaler.skipped_steps == 1 and plugin.scaler.get_scale() == 2.0**7


@pytest.mark.parametrize(
    ("module", "clip", "rechecks"),
    [
        (_NanHook, {}, 4),  # observing path: one extra read per step
        (_NanHook, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, 4),  # clamp keeps NaN
        (_NanHook, {"gradient_clip_val": 1.0}, 0),  # the norm clip after the hooks re-checks
        (_Auto, {}, 0),  # nobody observes: the step's own check covers everything
    ],
)
def test_the_recheck_reads_only_where_hooks_observe(
    module: type, clip: dict[str, Any], rechecks: int
) -> None:
    plugin = _plugin()
    assert plugin.scaler is not None
    # recheck_ and the value clip's check before its clamp both read through _recheck.
    with mock.patch.object(plugin.scaler, "_recheck", wraps=plugin.scaler._recheck) as spy:
        _fit(module(), plugin, **clip)
    assert spy.call_count == rechecks


# -- 3. manual optimization ---------------------------------------------------------------------


class _Manual(LightningModule):
    """Manual optimization with a critic stepped ``n_critic`` times per batch (WGAN style) and a generator.

    ``poison`` holds (batch_idx, critic_iteration) pairs whose critic gradient gets a NaN.
    """

    def __init__(
        self, n_critic: int = 1, poison: tuple[tuple[int, int], ...] = (), scheds: bool = False
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen, self.critic = nn.Linear(8, 8), nn.Linear(8, 1)
        self.n_critic, self.poison, self.scheds = n_critic, poison, scheds
        self.flags: list[bool] = []  # last_step_skipped right after each critic step
        self.scales: list[list[float]] = []  # the scale after each critic step, per batch
        self.critic_changed: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()  # type: ignore[misc]
        plugin = self.trainer.precision_plugin
        x = batch[0]
        scales = []
        for i in range(self.n_critic):
            self.manual_backward(self.critic(self.gen(x).detach()).pow(2).mean())
            if (batch_idx, i) in self.poison:
                self.critic.weight.grad[0, 0] = float("nan")
            before = self.critic.weight.detach().clone()
            opt_c.step()
            opt_c.zero_grad()
            self.flags.append(plugin.last_step_skipped)
            self.critic_changed.append(not torch.equal(before, self.critic.weight))
            scales.append(plugin.scaler.get_scale())
        self.scales.append(scales)
        self.manual_backward(self.critic(self.gen(x)).pow(2).mean())
        opt_g.step()
        opt_g.zero_grad()
        if self.scheds:
            for sched in self.lr_schedulers():  # type: ignore[union-attr]
                sched.step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.SGD(self.gen.parameters(), lr=0.1)
        opt_c = torch.optim.SGD(self.critic.parameters(), lr=0.1)
        if not self.scheds:
            return opt_g, opt_c
        step = {"interval": "step"}
        return (
            {
                "optimizer": opt_g,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5), **step},
            },
            {
                "optimizer": opt_c,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt_c, 1, 0.5), **step},
            },
        )


def test_last_step_skipped_describes_the_step_just_taken() -> None:
    module = _Manual(poison=((2, 0),))
    _fit(module, _plugin())
    assert module.flags == [False, False, True, False]  # was one batch late: [F, F, F, T]


def test_a_skipped_manual_step_holds_its_own_optimizers_scheduler() -> None:
    module = _Manual(poison=((1, 0), (3, 0)), scheds=True)
    trainer = _fit(module, _plugin())
    opt_g, opt_c = trainer.optimizers
    assert opt_g.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)  # the generator stepped 4 times
    assert opt_c.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the critic skipped 2 of 4


def test_wgan_critic_steps_several_times_per_batch() -> None:
    module = _Manual(n_critic=3, poison=((1, 1),))
    plugin = _plugin()
    _fit(module, plugin, batches=3)
    assert plugin.scaler is not None
    assert module.flags == [False] * 4 + [True] + [False] * 4  # each critic step on its own gradients
    assert module.critic_changed == [True] * 4 + [False] + [True] * 4
    assert plugin.scaler.total_steps == 3 and plugin.scaler.skipped_steps == 1  # one update per batch
    assert module.scales == [[2.0**8] * 3, [2.0**8] * 3, [2.0**7] * 3]  # backs off at the batch's end
    assert _finite(module)


def test_stepping_twice_without_a_backward_in_between_raises() -> None:
    class Twice(_Manual):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            _, opt_c = self.optimizers()  # type: ignore[misc]
            self.manual_backward(self.critic(batch[0]).mean())
            opt_c.step()
            opt_c.step()

    with pytest.raises(RuntimeError, match=r"stepped twice.*no backward.*HINT"):
        _fit(Twice(), _plugin(), batches=1)


class _RecordAutocast(torch.autograd.Function):
    """Identity whose backward records whether CPU autocast is on while it runs."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _RecordAutocast.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


@pytest.mark.parametrize("manual", [True, False])
def test_backward_runs_with_autocast_off(manual: bool) -> None:
    class Probe(_Auto):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = _RecordAutocast.apply(self.net(batch[0])).float().pow(2).mean()
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]
            return None

    _RecordAutocast.seen.clear()
    _fit(Probe(), _plugin(), batches=2)
    assert _RecordAutocast.seen == [False, False]  # manual_backward ran inside training_step's autocast
