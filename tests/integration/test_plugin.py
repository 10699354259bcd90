"""AMPPrecision in real Trainer.fit runs; Lightning's MixedPrecision is the oracle where it is right."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.lightning import CHECKPOINT_KEY
from tests._ops import UNSCALE, AtenOps

POISON_STEPS = (0, 7, 8, 19)  # the first step overflows, as it often does at 2**16


def _loader(n: int = 30, batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n * batch, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


class TinyModule(LightningModule):
    """A small regression model that poisons its gradients at chosen steps."""

    def __init__(
        self, poison: tuple[int, ...] = POISON_STEPS, fused: bool = False, sched: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.poison, self.fused, self.sched = poison, fused, sched
        self.dtypes: list[torch.dtype] = []
        self.losses_seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.dtypes.append(out.dtype)
        return nn.functional.mse_loss(out.float(), y)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.losses_seen.append(loss.item())

    def on_after_backward(self) -> None:
        if self.global_step in self.poison:
            self.net[2].weight.grad[0, 3] = float("inf")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        if not self.sched:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(module: LightningModule, plugin: Any, steps: int = 30, **trainer_kwargs: Any) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, _loader())
    return trainer


def _scaler_kwargs() -> dict[str, Any]:
    return {"init_scale": 2.0**16, "growth_interval": 5}


def _oracle(**trainer_kwargs: Any) -> tuple[TinyModule, torch.amp.GradScaler]:
    module = TinyModule()
    scaler = torch.amp.GradScaler("cpu", **_scaler_kwargs())
    _fit(module, MixedPrecision("16-mixed", "cpu", scaler=scaler), **trainer_kwargs)
    return module, scaler


def _ours(clip_fused: Any = "auto", **trainer_kwargs: Any) -> tuple[TinyModule, LossScaler]:
    module = TinyModule()
    scaler = LossScaler(**_scaler_kwargs())
    _fit(
        module, AMPPrecision("16-mixed", device="cpu", scaler=scaler, clip_fused=clip_fused), **trainer_kwargs
    )
    return module, scaler


def test_matches_lightning_mixed_precision_bit_for_bit() -> None:
    (ref, ref_scaler), (ours, scaler) = _oracle(), _ours()
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.skipped_steps >= len(POISON_STEPS) and scaler.total_steps == 30  # + warm-up overflows
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert set(ours.dtypes) == {torch.float16}  # fp16 honoured on CPU


@pytest.mark.parametrize(("clip_fused", "exact"), [("auto", False), (False, True)])
def test_clipping_matches_lightning_mixed_precision(clip_fused: Any, exact: bool) -> None:
    (ref, ref_scaler), (ours, scaler) = (
        _oracle(gradient_clip_val=0.5),
        _ours(clip_fused, gradient_clip_val=0.5),
    )
    assert scaler.get_scale() == ref_scaler.get_scale()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_on_before_backward_sees_the_unscaled_loss() -> None:
    ours, _ = _ours()
    ref, _ = _oracle()
    # Same weights at step 0: Lightning hands the hook the loss times 2**16, we hand over the loss.
    assert ours.losses_seen[0] * 2**16 == pytest.approx(ref.losses_seen[0], rel=1e-6)


class _OwnBackward(TinyModule):
    """Overrides ``LightningModule.backward`` and calls ``loss.backward()`` its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.backward_losses: list[float] = []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_losses.append(loss.item())
        loss.backward()


def test_an_overridden_backward_gets_the_scaled_loss_and_trains_bit_for_bit_as_lightning() -> None:
    """The plugin starts backward from the scaler's seed only through ``LightningModule.backward``,
    which hands ``gradient=`` on; an override that drops it is given the scaled loss instead."""
    (ref, ref_scaler), (ours, scaler) = _oracle(), _ours()
    own = _OwnBackward()
    own_scaler = LossScaler(**_scaler_kwargs())
    _fit(own, AMPPrecision("16-mixed", device="cpu", scaler=own_scaler))
    assert own.backward_losses[0] == pytest.approx(own.losses_seen[0] * 2**16, rel=1e-6)
    assert own_scaler.get_scale() == scaler.get_scale() == ref_scaler.get_scale()
    assert own_scaler.skipped_steps == scaler.skipped_steps
    for a, b, c in zip(own.parameters(), ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


class _ObservingModule(TinyModule):
    def __init__(self) -> None:
        super().__init__(poison=())
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append(torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item())


def test_hooks_see_unscaled_gradients_when_they_look() -> None:
    module = _ObservingModule()
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=2.0**12))
    with AtenOps() as ops:
        _fit(module, plugin, steps=3)
    assert ops.counts[UNSCALE] == 2 * 3  # before the hook and a re-check after it, every step
    assert plugin.scaler is not None and plugin.scaler.skipped_steps == 0
    assert 0 < max(module.norms) < 2.0**8  # unscaled: scaled ones would be thousands of times larger


def test_fast_path_when_nobody_looks() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=2.0**8))
    with AtenOps() as ops:
        _fit(TinyModule(poison=()), plugin, steps=2, gradient_clip_val=1.0)
    assert ops.counts[UNSCALE] == 0  # the clip reads the scaled gradients once; no unscale pass
    assert plugin.last_grad_norm is not None and torch.isfinite(plugin.last_grad_norm)


class _NormProbe(TinyModule):
    def __init__(self) -> None:
        super().__init__(poison=())
        self.true_norms: list[float] = []

    def on_after_backward(self) -> None:  # scaled gradients: divide by the known scale
        grads = torch.cat([p.grad.flatten() for p in self.parameters()])
        self.true_norms.append(
            grads.double().norm().item() / self.trainer.precision_plugin.scaler.get_scale()
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.trainer.precision_plugin.request_grad_norm()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_requested_grad_norm_is_unscaled_and_costs_nothing_when_not_asked(precision: str) -> None:
    module = _NormProbe()
    scaler = LossScaler(init_scale=2.0**8) if precision == "16-mixed" else None
    plugin = AMPPrecision(precision, device="cpu", scaler=scaler)  # type: ignore[arg-type]
    if scaler is None:
        module.on_after_backward = lambda: module.true_norms.append(  # type: ignore[method-assign]
            torch.cat([p.grad.flatten() for p in module.parameters()]).double().norm().item()
        )
    _fit(module, plugin, steps=1)
    assert plugin.last_grad_norm is not None
    assert plugin.last_grad_norm.item() == pytest.approx(module.true_norms[-1], rel=1e-5)
    plain = AMPPrecision(precision, device="cpu", scaler=LossScaler(init_scale=2.0**8) if scaler else None)  # type: ignore[arg-type]
    _fit(TinyModule(poison=()), plain, steps=1)
    assert plain.last_grad_norm is None  # not asked, not computed


def test_fused_adamw_with_clipping_matches_unfused() -> None:
    results = []
    for fused in (False, True):
        module = TinyModule(fused=fused)
        scaler = LossScaler(**_scaler_kwargs())
        _fit(module, AMPPrecision("16-mixed", device="cpu", scaler=scaler), gradient_clip_val=0.5)
        results.append((module, scaler.get_scale(), scaler.skipped_steps))
    (unfused, s1, k1), (fused, s2, k2) = results
    assert (s1, k1) == (s2, k2)
    for p, q in zip(unfused.parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_lightning_refuses_what_we_support() -> None:
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(TinyModule(fused=True), MixedPrecision("16-mixed", "cpu"), steps=2, gradient_clip_val=0.5)


def test_gradient_accumulation_discards_the_whole_step() -> None:
    module = TinyModule(poison=(2,))
    scaler = LossScaler(init_scale=2.0**8)
    _fit(module, AMPPrecision("16-mixed", device="cpu", scaler=scaler), steps=5, accumulate_grad_batches=2)
    assert scaler.total_steps == 5 and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**7  # one backoff for one optimizer step of 2 micro-batches


@pytest.mark.parametrize(("lr_on_skip", "halvings"), [("hold", 4), ("advance", 6)])
def test_scheduler_held_on_skipped_steps_without_order_warning(lr_on_skip: str, halvings: int) -> None:
    module = TinyModule(poison=(0, 3), sched=True)
    scaler = LossScaler(init_scale=2.0**8)
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=scaler, lr_on_skip=lr_on_skip)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(module, plugin, steps=6)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**halvings)


class _GanModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen, self.disc = nn.Linear(4, 4), nn.Linear(4, 1)
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        x = batch[0][:, :4]
        loss_d = self.disc(x).pow(2).mean()
        self.manual_backward(loss_d)
        if batch_idx == 2:
            self.disc.weight.grad[0, 0] = float("nan")  # only the discriminator overflows
        opt_d.step()
        opt_d.zero_grad()
        loss_g = self.disc(self.gen(x)).pow(2).mean()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.snapshots.append((self.gen.weight.detach().clone(), self.disc.weight.detach().clone()))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.gen.parameters(), lr=0.1), torch.optim.SGD(self.disc.parameters(), lr=0.1)


def test_two_optimizers_one_overflows_one_backoff_per_batch() -> None:
    module = _GanModule()
    scaler = LossScaler(init_scale=2.0**8, growth_interval=1000)
    _fit(module, AMPPrecision("16-mixed", device="cpu", scaler=scaler), steps=8)  # 4 batches x 2 steps
    assert scaler.total_steps == 4 and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**7
    (g2, d2), (g3, d3) = module.snapshots[2], module.snapshots[3]
    assert torch.equal(d2, d3)  # the discriminator skipped batch 2
    assert not torch.equal(g2, g3)  # the generator stepped; its own gradients were finite


def test_lightnings_mixed_precision_updates_the_scale_after_every_optimizer_step() -> None:
    """comparison.md, Lightning's cell: two optimizers per batch make two scale updates per batch."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    updates: list[float] = []
    update = scaler.update
    scaler.update = lambda *a, **k: (updates.append(scaler.get_scale()), update(*a, **k))[1]  # type: ignore[method-assign]
    _fit(_GanModule(), MixedPrecision("16-mixed", "cpu", scaler=scaler), steps=8)  # 4 batches x 2 steps
    assert len(updates) == 8  # ours: 4, one per batch (see the test above); growth counts steps, not batches


def test_lightnings_mixed_precision_steps_the_scheduler_of_a_skipped_step_with_torchs_warning() -> None:
    """comparison.md, Lightning's cell: a skipped first step, then the scheduler steps (Lightning #5558)."""
    module = TinyModule(poison=(0,), sched=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(module, MixedPrecision("16-mixed", "cpu", scaler=scaler), steps=3)
    assert [w for w in caught if "lr_scheduler.step()` before `optimizer.step()" in str(w.message)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)  # 3 advances


class _ManualClipModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(8, 1)
        self.clipped_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        self.manual_backward(self.net(batch[0]).pow(2).sum())
        self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
        self.clipped_norms.append(torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item())
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_clips_unscaled_gradients() -> None:
    """Lightning issue 18089: clip_gradients after manual_backward clipped the scaled gradients."""
    module = _ManualClipModule()
    scaler = LossScaler(init_scale=2.0**8)
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=scaler)
    module.on_train_batch_start = lambda *_: plugin.request_grad_norm()  # type: ignore[method-assign]
    _fit(module, plugin, steps=3)
    assert scaler.skipped_steps == 0
    assert module.clipped_norms == pytest.approx([1e-3] * 3, rel=1e-3)
    assert plugin.last_grad_norm is not None and plugin.last_grad_norm > 0.1  # the norm before the clip


def test_lightnings_manual_clip_gradients_clips_the_scaled_gradients() -> None:
    """comparison.md, Lightning's cell (issue 18089): the clip sees gradients still times the scale."""

    def step_sizes(plugin: Any) -> list[float]:
        module = _ManualClipModule()
        weights = [torch.cat([p.detach().flatten() for p in module.parameters()])]
        module.on_train_batch_end = lambda *_: weights.append(  # type: ignore[method-assign]
            torch.cat([p.detach().flatten() for p in module.parameters()])
        )
        _fit(module, plugin, steps=3)
        return [(b - a).norm().item() / 0.1 for a, b in itertools.pairwise(weights)]  # SGD, lr 0.1

    lightning = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    ours = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=2.0**8))
    # fp32 weights round such small steps: 5% is far tighter than the factor of 2**8 between the two.
    assert step_sizes(lightning) == pytest.approx([1e-3 / 2**8] * 3, rel=5e-2)  # clipped while scaled
    assert step_sizes(ours) == pytest.approx([1e-3] * 3, rel=5e-2)


class _NoGradBackward(LightningModule):
    """Manual optimization whose backward runs under ``torch.no_grad()`` (torch allows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = self.net(batch[0]).pow(2).mean()
        with torch.no_grad():
            self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_backward_under_no_grad_trains_as_in_torch_where_lightnings_fp16_raises() -> None:
    """CHANGELOG: torch's backward works under no_grad; Lightning's fp16 scales the loss there, which
    then has no graph. Ours starts backward from the seed, and its scaled route tracks the product."""
    lightning = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="does not require grad"):
        _fit(_NoGradBackward(), lightning, steps=2)
    module = _NoGradBackward()
    before = module.net.weight.detach().clone()
    scaler = LossScaler(init_scale=2.0**8)
    _fit(module, AMPPrecision("16-mixed", device="cpu", scaler=scaler), steps=2)
    assert scaler.total_steps == 2 and scaler.skipped_steps == 0
    assert not torch.equal(module.net.weight, before)


def test_manual_optimization_double_step_raises() -> None:
    class Twice(_ManualClipModule):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            self.manual_backward(self.net(batch[0]).sum())
            for _ in range(2):  # a second step needs a backward of its own (a WGAN critic has one)
                opt.step()

    with pytest.raises(RuntimeError, match=r"stepped twice in one training_step.*HINT"):
        _fit(Twice(), AMPPrecision("16-mixed", device="cpu"), steps=2)


def _fit_epochs(
    module: LightningModule, plugin: Any, epochs: int, ckpt: str | None = None, **trainer_kwargs: Any
) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, _loader(n=5), ckpt_path=ckpt)
    return trainer


def _plugin() -> AMPPrecision:
    return AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=2.0**16, growth_interval=2))


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    full = TinyModule(poison=(1, 2))
    full_plugin = _plugin()
    _fit_epochs(full, full_plugin, epochs=2)

    head = TinyModule(poison=(1, 2))
    head_plugin = _plugin()
    trainer = _fit_epochs(head, head_plugin, epochs=1)
    path = str(tmp_path / "step5.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert head_plugin.scaler is not None
    assert saved[CHECKPOINT_KEY]["scaler"]["skipped_steps"] == head_plugin.scaler.skipped_steps >= 2
    assert "AMPPrecision" not in saved  # not under the class name

    tail = TinyModule(poison=(1, 2))
    resumed = _plugin()
    _fit_epochs(tail, resumed, epochs=2, ckpt=path)
    assert resumed.scaler is not None and full_plugin.scaler is not None
    assert resumed.scaler.get_scale() == full_plugin.scaler.get_scale()
    assert resumed.scaler.state_dict() == full_plugin.scaler.state_dict()
    for p, q in zip(full.parameters(), tail.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loads_a_lightning_mixed_precision_checkpoint(tmp_path: Path) -> None:
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    trainer = _fit_epochs(
        TinyModule(poison=(1,)), MixedPrecision("16-mixed", "cpu", scaler=ref_scaler), epochs=1
    )
    path = str(tmp_path / "lightning.ckpt")
    trainer.save_checkpoint(path)
    assert "MixedPrecision" in torch.load(path, weights_only=False)
    plugin = AMPPrecision("16-mixed", device="cpu")
    _fit_epochs(TinyModule(poison=()), plugin, epochs=1, ckpt=path)  # max_epochs=1: restore only
    assert plugin.scaler is not None
    assert plugin.scaler.get_scale() == ref_scaler.get_scale()
    assert plugin.scaler.get_growth_interval() == 2


def test_auto_picks_bf16_on_cpu_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    module = TinyModule(poison=())
    plugin = AMPPrecision("auto")
    with caplog.at_level("INFO"):
        _fit(module, plugin, steps=2)
    assert plugin.precision == "bf16-mixed" and plugin.scaler is None
    assert set(module.dtypes) == {torch.bfloat16}
    assert "chose bf16-mixed" in caplog.text


def test_bf16_clipping_records_the_norm() -> None:
    plugin = AMPPrecision("bf16-mixed")
    _fit(TinyModule(poison=()), plugin, steps=2, gradient_clip_val=0.1)
    assert plugin.last_grad_norm is not None and plugin.last_grad_norm > 0.1


class _Fp32Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.seen.append(out.dtype)
        return out


def test_fp32_modules_run_in_fp32() -> None:
    module = TinyModule(poison=())
    module.net[2] = _Fp32Head()
    _fit(module, AMPPrecision("bf16-mixed", fp32_modules=[_Fp32Head]), steps=2)
    assert set(module.net[2].seen) == {torch.float32}


class _SigmoidModule(TinyModule):
    """Records, per training/validation step, the dtypes of a Linear output and of a few functions."""

    def __init__(self) -> None:
        super().__init__(poison=())
        self.seen: list[dict[str, torch.dtype]] = []

    def _record(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[0](x)
        gate = torch.sigmoid(hidden)
        self.seen.append({"linear": hidden.dtype, "sigmoid": gate.dtype, "tanh": torch.tanh(hidden).dtype,
                          "method": hidden.sigmoid().dtype})  # fmt: skip
        return self.net[2](gate * hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self._record(batch[0]).float(), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record(batch[0])


@pytest.mark.parametrize(("precision", "half"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_fp32_functions_return_fp32_in_training_step_while_linear_stays_half(
    precision: str, half: torch.dtype
) -> None:
    module = _SigmoidModule()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, plugins=[
            AMPPrecision(precision, device="cpu", fp32_functions=(torch.sigmoid,))  # type: ignore[arg-type]
        ], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader(n=2), _loader(n=1))
    # the registered function is fp32; Linear, unregistered tanh and the method x.sigmoid() keep autocast's
    expected = {"linear": half, "sigmoid": torch.float32, "tanh": half, "method": half}
    assert len(module.seen) >= 3 and all(seen == expected for seen in module.seen)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert torch.sigmoid(torch.ones(1, dtype=half)).dtype == half  # nothing left behind after fit


def test_fp16_parameters_fail_at_fit_start_naming_them() -> None:
    module = TinyModule(poison=())
    module.net[0].half()
    with pytest.raises(ValueError, match=r"net\.0\.weight"):
        _fit(module, AMPPrecision("16-mixed", device="cpu"), steps=1)


def test_lbfgs_under_fp16_raises() -> None:
    class WithLBFGS(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match=r"LBFGS.*HINT"):
        _fit(WithLBFGS(poison=()), AMPPrecision("16-mixed", device="cpu"), steps=1)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lbfgs_without_a_loss_scaler_steps_with_its_closure_as_lightning_does(precision: str) -> None:
    # What the fp16 refusal's HINT offers: LBFGS runs its closure itself, several times per step,
    # so it gets the closure, unguarded (with a warning), as under Lightning's own plugins.
    class WithLBFGS(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    oracle = WithLBFGS(poison=())
    reference = MixedPrecision("bf16-mixed", "cpu") if precision == "bf16-mixed" else "32-true"
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.01,
        **({"plugins": [reference]} if precision == "bf16-mixed" else {"precision": reference}),
    )  # fmt: skip
    trainer.fit(oracle, _loader())
    module = WithLBFGS(poison=())
    with pytest.warns(UserWarning, match=r"LBFGS.*not checked"):
        _fit(module, AMPPrecision(precision, device="cpu"), steps=2, gradient_clip_val=0.01)  # type: ignore[arg-type]
    for ours, theirs in zip(module.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_plain_data_parallel_under_bf16_warns() -> None:
    # nn.DataParallel runs on the GPUs where there are any (its module must be on the first one).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module = TinyModule(poison=())
    module.net = nn.DataParallel(module.net)  # type: ignore[assignment]
    trainer = Trainer(
        accelerator=device, devices=1, max_steps=1, plugins=[AMPPrecision("bf16-mixed")], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="AutocastDataParallel"):
        trainer.fit(module, _loader())


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_that_emulates_half_precision_is_named(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amp_plugin.precision.native_on_cpu", lambda dtype: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AMPPrecision("auto", device="cpu")
    said = [str(w.message) for w in caught if "emulates bf16" in str(w.message)]
    assert len(said) == (0 if native else 1)
    assert native or "HINT: train in fp32" in said[0]


def test_a_norm_requested_before_fit_resolves_nothing_early_and_is_kept() -> None:
    """Asked before fit: the precision resolves on the model's device still; the first step keeps the norm."""
    plugin = AMPPrecision("bf16-mixed")  # the device comes from the model at fit
    plugin.request_grad_norm()
    assert plugin.device is None
    module = TinyModule(poison=())
    _fit(module, plugin, steps=1)
    assert plugin.device == "cpu" and plugin.last_grad_norm is not None
