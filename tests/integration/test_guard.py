"""Every precision is guarded: a non-finite loss or gradient skips the step, in every mode.

Each case trains a small model, makes one batch non-finite (a NaN loss, or an inf written into
a gradient after backward), and checks that over that batch the parameters and the optimizer
state stay bit-identical, that the next batches train, that the skip is counted where fp16
counts it, and that a step-interval LR scheduler is held.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaleMonitor, LossScaler

BAD = 2  # the batch that goes non-finite

PRECISIONS: list[dict[str, Any]] = [
    {"precision": "16-mixed"},
    {"precision": "bf16-mixed"},
    {"precision": "32-true"},
    {"precision": "bf16-true"},
    {"precision": "bf16-true", "rounding": "stochastic"},
    {"precision": "bf16-true", "rounding": "kahan"},
    {"precision": "16-true"},
    {"precision": "16-mixed", "master_weights": True},
    {"precision": "bf16-mixed", "master_weights": True},
]


def _id(kw: dict[str, Any]) -> str:
    return "-".join(str(v) for v in kw.values())


def _loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batches * 4, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class _Model(LightningModule):
    def __init__(self, how: str, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.how, self.optimizer_name = how, optimizer
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None
        self.params_per_batch: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        if batch_idx == BAD and self.how == "nan_loss":
            loss = loss + float("nan")  # the gradients stay finite: only the loss says so
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.batch_idx == BAD and self.how == "inf_grad":
            grad = self.net[2].weight.grad
            assert grad is not None
            grad[0, 3] = float("inf")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == BAD:
            self.before = _snapshot(self)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == BAD:
            self.after = _snapshot(self)
        self.params_per_batch.append([p.detach().clone() for p in self.parameters()])

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-4, fused=self.optimizer_name == "fused_adamw")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _snapshot(module: LightningModule) -> dict[str, Any]:
    opt = module.trainer.optimizers[0]
    plugin = module.trainer.precision_plugin
    masters = getattr(plugin, "masters", None)
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "opt": copy.deepcopy(opt.state_dict()),
        "masters": [] if masters is None else [m.detach().clone() for m in masters.masters()],
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _fit(module: LightningModule, plugin: AMPPrecision, batches: int = 6) -> tuple[Trainer, LossScaleMonitor]:
    monitor = LossScaleMonitor()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=batches, plugins=[plugin],
        callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, _loader(batches))
    return trainer, monitor


def _optimizers(kw: dict[str, Any]) -> list[str]:
    fused_ok = kw.get("rounding", "nearest") == "nearest" and kw["precision"] != "16-true"
    return ["sgd", "adamw"] + (["fused_adamw"] if fused_ok else [])


CASES = [
    pytest.param(kw, opt, how, id=f"{_id(kw)}-{opt}-{how}")
    for kw in PRECISIONS
    for opt in _optimizers(kw)
    for how in ("nan_loss", "inf_grad")
]


@pytest.mark.parametrize(("kw", "optimizer", "how"), CASES)
def test_a_non_finite_batch_is_skipped_in_every_precision(
    kw: dict[str, Any], optimizer: str, how: str
) -> None:
    module = _Model(how, optimizer)
    if kw["precision"].startswith("16-"):  # no warm-up overflows: only the poisoned batch skips
        kw = {**kw, "scaler": LossScaler(init_scale=2.0**8, growth_interval=1000)}
    plugin = AMPPrecision(device="cpu", **kw)
    trainer, _ = _fit(module, plugin)
    assert module.before is not None and module.after is not None
    if optimizer == "fused_adamw":
        # The fused step skips on the device and nothing reads its flag at once: the scheduler holds
        # a step late (after the monitor's next read), so only the learning rate may move here.
        for snap in (module.before, module.after):
            snap["opt"]["param_groups"] = [{**g, "lr": None} for g in snap["opt"]["param_groups"]]
    assert _equal(module.before, module.after), "the non-finite batch changed the training state"
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    # the batches after it trained
    assert not torch.equal(module.params_per_batch[BAD][0], module.params_per_batch[-1][0])
    assert plugin.guard is not None and plugin.guard.skipped_steps == 1
    assert trainer.callback_metrics["amp/skipped_steps"].item() == 1
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 5  # 6 batches, one held


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_guard_false_turns_the_guard_off(precision: str) -> None:
    module = _Model("inf_grad", "sgd")
    plugin = AMPPrecision(precision, device="cpu", guard=False)
    assert plugin.guard is None
    _fit(module, plugin)
    assert not all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_guard_false_with_fp16_scaling_is_refused() -> None:
    with pytest.raises(ValueError, match=r"guard=False.*HINT"):
        AMPPrecision("16-mixed", device="cpu", guard=False)


@pytest.mark.parametrize(
    "scaler",
    [
        lambda: torch.amp.GradScaler("cuda"),
        lambda: LossScaler("cuda"),
        lambda: LossScaler("cpu", enabled=False),
    ],
    ids=["GradScaler-cuda", "LossScaler-cuda", "LossScaler-disabled"],
)
def test_a_disabled_scaler_is_refused_before_training_unguarded_fp16(
    scaler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a 'cuda' scaler disables itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = scaler()
    with pytest.raises(ValueError, match=r"disabled.*HINT"):
        AMPPrecision("16-mixed", device="cpu", scaler=made)


def test_the_loss_scaler_warning_for_cuda_without_cuda_has_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, anywhere
    with pytest.warns(UserWarning, match="HINT"):
        LossScaler("cuda")


class _HookNan(_Model):
    """A hook that sees the gradients (so they are not checked before it) writes a NaN into one."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.fit_loop.batch_idx == BAD:
            grad = self.net[0].weight.grad
            assert grad is not None
            grad[0, 0] = float("nan")


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_nan_written_by_a_hook_is_caught_by_the_guards_one_check(precision: str, clip: str | None) -> None:
    module = _HookNan("none", "sgd")
    plugin = AMPPrecision(precision, device="cpu")
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=6, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=None if clip is None else 1.0, gradient_clip_algorithm=clip,
    )  # fmt: skip
    trainer.fit(module, _loader(6))
    assert module.before is not None and _equal(module.before, module.after)
    assert plugin.guard is not None and plugin.guard.skipped_steps == 1
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_the_guards_counts_resume_from_a_bf16_checkpoint(tmp_path: Any) -> None:
    module = _Model("inf_grad", "sgd")
    plugin = AMPPrecision("bf16-mixed", device="cpu")
    trainer, _ = _fit(module, plugin, batches=4)
    path = tmp_path / "bf16.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["amp_plugin"]["guard"]["skipped_steps"] == 1
    resumed = AMPPrecision("bf16-mixed", device="cpu")
    more = Trainer(
        accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=4, plugins=[resumed], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    more.fit(_Model("none", "sgd"), _loader(4), ckpt_path=path)
    assert resumed.guard is not None
    assert (resumed.guard.skipped_steps, resumed.guard.total_steps) == (1, 8)


def test_a_corrupt_guard_entry_is_refused_before_anything_loads() -> None:
    plugin = AMPPrecision("bf16-mixed", device="cpu")
    entry = {"precision": "bf16-mixed", "scaler": {}, "guard": {"scale": -1}}
    with pytest.raises(ValueError, match="HINT"):
        plugin.check_checkpoint({"amp_plugin": entry})


class _NoneAt(_Model):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_batch_that_returns_none_is_no_skip_of_the_next_one(precision: str) -> None:
    scaler = LossScaler(init_scale=2.0**8, growth_interval=1000) if precision == "16-mixed" else None
    plugin = AMPPrecision(precision, device="cpu", scaler=scaler)
    _, monitor = _fit(_NoneAt("none", "sgd"), plugin)
    assert plugin.guard is not None and plugin.guard.skipped_steps == 0
    assert "5 steps, 0 skipped" in monitor.summary()
