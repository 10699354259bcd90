"""AMPPrecision as a drop-in for Lightning: a MixedPrecision; GradScaler input; bad input; checkpoints."""

from __future__ import annotations

import copy
import inspect
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin import plugin as plugin_module
from amp_plugin.plugin import CHECKPOINT_KEY


def _loader() -> DataLoader:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class _Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(plugin: Any, steps: int = 2, **kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


# -- 4. a MixedPrecision to Lightning ------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
def test_lightning_treats_it_as_mixed_precision(precision: str, dtype: torch.dtype) -> None:
    plugin = AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    assert isinstance(plugin, MixedPrecision)
    # What ThroughputMonitor.setup computes its FLOPs for (it reported float32 for both before).
    assert throughput_monitor._plugin_to_compute_dtype(plugin) == dtype


def test_every_mixed_precision_method_is_our_own() -> None:
    """Methods inherited from MixedPrecision would drive a torch GradScaler; a new one must fail here."""
    inherited = {name for name, value in vars(MixedPrecision).items() if inspect.isfunction(value)}
    inherited |= {n for n, v in vars(MixedPrecision).items() if isinstance(v, (staticmethod, classmethod))}
    assert inherited <= set(vars(AMPPrecision)), sorted(inherited - set(vars(AMPPrecision)))


def test_lightning_internals_we_read_still_exist() -> None:
    """Pins each Lightning internal listed in plugin.py's compat section: a rename fails here."""
    module = _Module()
    assert plugin_module._compat_trainer(module) is None
    trainer = _trainer(AMPPrecision("bf16-mixed", device="cpu"), steps=1)
    trainer.fit(module, _loader())
    assert plugin_module._compat_trainer(module) is trainer
    # We override Precision._after_closure, the hook Lightning calls between the closure and the step.
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    assert "_after_closure" in inspect.getsource(MixedPrecision.optimizer_step)
    assert "_after_closure" in inspect.getsource(Precision._wrap_closure)


def test_a_callback_that_observes_gradients_takes_the_observing_path() -> None:
    from lightning.pytorch import Callback

    class Observer(Callback):
        def on_before_optimizer_step(
            self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
        ) -> None:
            pass

    plugin = AMPPrecision("16-mixed", device="cpu")
    _trainer(plugin, steps=1, callbacks=[Observer()]).fit(_Module(), _loader())
    assert not plugin._fast_clip
    plugin = AMPPrecision("16-mixed", device="cpu")
    _trainer(plugin, steps=1).fit(_Module(), _loader())
    assert plugin._fast_clip


# -- 5. a torch.amp.GradScaler is accepted --------------------------------------------------------


def _stepped_grad_scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
    )
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(5):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if i == 1:
            model.weight.grad.fill_(math.inf)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def test_a_grad_scaler_is_converted_with_its_settings_and_state() -> None:
    grad_scaler = _stepped_grad_scaler()
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=grad_scaler)  # type: ignore[arg-type]
    scaler = plugin.scaler
    assert isinstance(scaler, LossScaler)
    assert scaler.get_scale() == grad_scaler.get_scale() == 1024.0 * 0.25 * 4.0
    assert (scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval) == (4.0, 0.25, 3)
    assert scaler.state_dict()["_growth_tracker"] == grad_scaler.state_dict()["_growth_tracker"] == 0
    grad_scaler2 = _stepped_grad_scaler()
    model = nn.Linear(2, 1)  # one more clean step: the tracker carries on from the GradScaler's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in (scaler, grad_scaler2):
        s.scale(model(torch.ones(1, 2)).sum()).backward()
        s.step(opt)
        s.update()
    assert scaler.state_dict()["_growth_tracker"] == grad_scaler2.state_dict()["_growth_tracker"] == 1


# -- 6. bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clip_fused": 1}, ValueError, r"clip_fused=1\) is not allowed: one of 'auto', True, False\. HINT"),
        ({"clip_fused": "True"}, ValueError, r"clip_fused='True'\) is not allowed.*HINT"),
        (
            {"lr_on_skip": None},
            ValueError,
            r"lr_on_skip=None\) is not allowed: one of 'hold', 'advance'\. HINT",
        ),
        (
            {"scaler": "LossScaler"},
            TypeError,
            r"scaler='LossScaler'\) is not allowed: an amp_plugin\.LossScaler or a torch\.amp\.GradScaler\. "
            "HINT",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AMPPrecision("16-mixed", device="cpu", **kwargs)


def _corrupt_entries() -> list[Any]:
    good = LossScaler(init_scale=8.0, growth_interval=4).state_dict()
    return [
        {"precision": "16-mixed", "scaler": {**good, "scale": math.nan}},
        {"precision": "16-mixed", "scaler": {**good, "_growth_tracker": 4}},
        ["not", "a", "dict"],
        {"precision": "16-mixed", "scaler": "garbage"},
    ]


@pytest.fixture
def good_checkpoint(tmp_path: Path) -> dict[str, Any]:
    trainer = _trainer(AMPPrecision("16-mixed", device="cpu"), steps=2)
    trainer.fit(_Module(), _loader())
    path = tmp_path / "good.ckpt"
    trainer.save_checkpoint(path)
    return dict(torch.load(path, weights_only=False), _path=str(tmp_path))


@pytest.mark.parametrize("entry", _corrupt_entries())
def test_a_corrupt_checkpoint_entry_is_refused_before_anything_of_the_plugin_changes(
    entry: Any, good_checkpoint: dict[str, Any]
) -> None:
    path = Path(good_checkpoint.pop("_path")) / "corrupt.ckpt"
    torch.save({**good_checkpoint, CHECKPOINT_KEY: entry}, path)
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=4.0))
    assert plugin.scaler is not None
    before = plugin.scaler.state_dict()
    module = _Module()
    trainer = _trainer(plugin, steps=4)
    with pytest.raises(ValueError, match="HINT"):
        trainer.fit(module, _loader(), ckpt_path=path)
    assert plugin.scaler.state_dict() == before
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01  # optimizer and scheduler not restored


@pytest.mark.parametrize("entry", _corrupt_entries())
def test_the_module_can_refuse_a_corrupt_entry_before_its_weights_are_replaced(
    entry: Any, good_checkpoint: dict[str, Any]
) -> None:
    """Lightning loads the weights before any precision-plugin hook; the module's own hook runs first."""

    class Guarded(_Module):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.trainer.precision_plugin.check_checkpoint(checkpoint)

    path = Path(good_checkpoint.pop("_path")) / "corrupt.ckpt"
    torch.save({**good_checkpoint, CHECKPOINT_KEY: entry}, path)
    module = Guarded()
    weights = copy.deepcopy(module.state_dict())
    with pytest.raises(ValueError, match="HINT"):
        _trainer(AMPPrecision("16-mixed", device="cpu"), steps=4).fit(module, _loader(), ckpt_path=path)
    for name, value in module.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_check_checkpoint_accepts_what_loads() -> None:
    plugin = AMPPrecision("16-mixed", device="cpu")
    good = LossScaler(init_scale=8.0).state_dict()
    for checkpoint in (
        {CHECKPOINT_KEY: {"precision": "16-mixed", "scaler": good}},
        {"MixedPrecision": good},
        {},
    ):
        plugin.check_checkpoint(checkpoint)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**16  # checking loads nothing


# -- the step-interval scheduler wrapper ------------------------------------------------------------


def _wrapped_scheduler() -> Any:
    plugin = AMPPrecision("16-mixed", device="cpu")
    trainer = _trainer(plugin, steps=2)
    trainer.fit(_Module(), _loader())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler).__name__ == "_SkipAwareScheduler"
    return scheduler


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_the_scheduler_wrapper_copies_and_pickles(how: str) -> None:
    scheduler = _wrapped_scheduler()
    clone = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    }[how](scheduler)
    assert type(clone) is type(scheduler)
    assert clone.state_dict() == scheduler.state_dict()
    assert clone.get_last_lr() == scheduler.get_last_lr()
    epoch = clone.last_epoch
    clone.step()  # still a working scheduler
    assert clone.last_epoch == epoch + 1
