"""AMPPrecision as a drop-in for Lightning, in Trainer.fit runs: the internals it reads; checkpoints."""

from __future__ import annotations

import copy
import inspect
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.lightning import CHECKPOINT_KEY, _compat
from tests._ops import UNSCALE, AtenOps


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

PINNED = [
    "after_closure",
    "attached_trainer",
    "before_backward_hooks",
    "called_by_fabric",
    "epoch_training_done",
    "init_fsdp_precision",
    "logged_step",
    "set_fabric_input_dtype",
    "should_update_logs",
]


class _LoggingWatch(Callback):
    """What LossScaleMonitor reads of Lightning's logging state, batch by batch."""

    def __init__(self) -> None:
        self.logged: list[bool] = []
        self.steps: list[int] = []
        self.epoch_done: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        self.logged.append(_compat.should_update_logs(trainer))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.steps.append(_compat.logged_step(trainer))
        self.epoch_done.append(_compat.epoch_training_done(trainer))


def test_lightning_internals_we_read_still_exist() -> None:
    """Pins every entry of amp_plugin/lightning/_compat.py and what it notes: a rename fails here."""
    assert sorted(_compat.__all__) == PINNED, "a new _compat entry needs its pin below"
    module = _Module()
    assert _compat.attached_trainer(module) is None
    watch = _LoggingWatch()
    trainer = _trainer(
        AMPPrecision("bf16-mixed", device="cpu"), steps=4, callbacks=[watch], log_every_n_steps=2
    )
    trainer.fit(module, _loader())
    assert _compat.attached_trainer(module) is trainer
    assert watch.logged == [False, True, False, True]  # every log_every_n_steps-th batch
    assert watch.steps == [0, 1, 2, 3]  # where the batch's own self.log metrics go: steps before it
    assert watch.epoch_done == [False, False, False, True]  # after the last batch of the (max_steps) epoch
    # The dict callback_metrics returns is kept: what a callback writes into it is still there.
    trainer.callback_metrics["amp/pinned"] = torch.tensor(1.0)
    assert "amp/pinned" in trainer.callback_metrics
    # We call Precision._after_closure, the hook Lightning runs between the closure and the step.
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    assert "_after_closure" in inspect.getsource(MixedPrecision.optimizer_step)
    assert "_after_closure" in inspect.getsource(Precision._wrap_closure)
    seen: list[Any] = []
    module.on_before_optimizer_step = seen.append  # type: ignore[method-assign]
    _compat.after_closure(trainer.precision_plugin, module, trainer.optimizers[0])
    assert seen == [trainer.optimizers[0]]
    # Precision.pre_backward runs the on_before_backward hooks with the loss it is given.
    module.on_before_backward = seen.append  # type: ignore[method-assign]
    loss = torch.tensor(3.0)
    _compat.before_backward_hooks(trainer.precision_plugin, loss, module)
    assert seen[-1] is loss
    # Fabric's throughput utilities read MixedPrecision._desired_input_dtype.
    from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision
    from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype

    fabric_plugin = FabricMixedPrecision("16-mixed", "cpu")
    _compat.set_fabric_input_dtype(fabric_plugin, torch.bfloat16)
    assert _plugin_to_compute_dtype(fabric_plugin) == torch.bfloat16
    # Fabric.setup calls the plugin's convert_module from lightning.fabric's own module.
    assert not _compat.called_by_fabric()
    assert "self._precision.convert_module(" in inspect.getsource(Fabric.setup)
    # FSDPPrecision.__init__ reads self.precision before it sets it: with the class default it
    # refuses any scaler; set first, the scaler passed is kept and no ShardedGradScaler is built.
    with pytest.raises(ValueError, match="does not use a scaler"):
        FSDPPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    fsdp = FSDPPrecision.__new__(FSDPPrecision)
    marker = object()
    _compat.init_fsdp_precision(fsdp, "16-mixed", marker)
    assert fsdp.scaler is marker and fsdp._desired_input_dtype == torch.float32


def test_a_callback_that_observes_gradients_takes_the_observing_path() -> None:
    class Observer(Callback):
        def on_before_optimizer_step(
            self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
        ) -> None:
            pass

    with AtenOps() as observed:
        observing = _trainer(AMPPrecision("16-mixed", device="cpu"), steps=1, callbacks=[Observer()])
        observing.fit(_Module(), _loader())
    with AtenOps() as unobserved:
        _trainer(AMPPrecision("16-mixed", device="cpu"), steps=1).fit(_Module(), _loader())
    # Unobserved, the step unscales and checks once; observed, before the hook and again after it.
    assert (observed.counts[UNSCALE], unobserved.counts[UNSCALE]) == (2, 1)


# -- 6. bad input ---------------------------------------------------------------------------------


def _corrupt_entries() -> list[Any]:
    good = LossScaler(init_scale=8.0, growth_interval=4).state_dict()
    return [
        {"precision": "16-mixed", "scaler": {**good, "scale": math.nan}},
        {"precision": "16-mixed", "scaler": {**good, "_growth_tracker": -1}},
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


# -- the step-interval scheduler wrapper ------------------------------------------------------------


def _wrapped_scheduler() -> Any:
    plugin = AMPPrecision("16-mixed", device="cpu")
    trainer = _trainer(plugin, steps=2)
    trainer.fit(_Module(), _loader())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler).__name__ == "SkipAwareScheduler"
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


class _Dtypes(LightningModule):
    """Records the dtype of a Linear's output in each training step (what autocast made of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.dtypes = nn.Linear(4, 1), []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.layer(batch[0])
        self.dtypes.append(out.dtype)
        return out.float().square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fp16_on_a_cpu_is_fp16_where_lightning_switches_to_bf16() -> None:
    """comparison.md: Lightning's "16-mixed" on a CPU warns and trains in bf16; ours trains in fp16."""
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    quiet: dict[str, Any] = dict(devices=1, max_steps=2, logger=False)
    quiet.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    theirs, ours = _Dtypes(), _Dtypes()
    with pytest.warns(UserWarning, match="fp16 is not supported on CPU"):
        lightning = Trainer(accelerator="cpu", precision="16-mixed", **quiet)
    lightning.fit(theirs, data)
    Trainer(accelerator="cpu", plugins=[AMPPrecision("16-mixed", device="cpu")], **quiet).fit(ours, data)
    assert (lightning.precision_plugin.precision, theirs.dtypes) == ("bf16-mixed", [torch.bfloat16] * 2)
    assert ours.dtypes == [torch.float16] * 2


class _NanAtStep1(_Dtypes):
    def on_after_backward(self) -> None:
        if self.global_step == 1:
            self.layer.weight.grad[0, 0] = math.nan


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lightning_steps_on_a_nan_gradient_without_a_scaler_and_ours_skips(precision: str) -> None:
    """comparison.md: with no loss scaler, Lightning applies an inf/NaN step; our guard skips it."""
    data = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)
    quiet: dict[str, Any] = dict(devices=1, max_steps=3, logger=False)
    quiet.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    theirs, ours = _NanAtStep1(), _NanAtStep1()
    ours.load_state_dict(theirs.state_dict())
    Trainer(accelerator="cpu", precision=precision, **quiet).fit(theirs, data)
    Trainer(accelerator="cpu", plugins=[AMPPrecision(precision, device="cpu")], **quiet).fit(ours, data)
    assert torch.isnan(theirs.layer.weight).any()  # the NaN step reached Lightning's weights
    assert torch.isfinite(ours.layer.weight).all()
    assert ours.trainer.precision_plugin.guard.skipped_steps == 1
