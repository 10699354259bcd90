"""What one guarded training batch costs, against Lightning's ``MixedPrecision`` on the same step.

Counted under a ``TorchDispatchMode`` (deterministic, unlike timings) from the batch's start to its
end, batch 3 of a short ``Trainer.fit``:

- aten ops (host reads apart, counted below): on a GPU each one that is not a view is a kernel
  launch, and a step that launches many small kernels waits on the host. The guard may add a
  handful.
- passes over the gradients: for each gradient tensor, the ops that read it plus the ops that
  write it (a read+write counts 2). The guard adds no pass when clipping computes a norm (the
  clip's own read checks them) and one read otherwise; fp16's clip reads the still-scaled
  gradients once and writes them once, where torch's recipe unscales first (two more passes).
- host reads (``aten._local_scalar_dense`` of a tensor on the device, each one waits for it): one
  added, shared by every reader of the skip: a non-fused optimizer is skipped on the host, and a
  fused one (which skips inside its kernel) has its flag read to hold the step-interval LR
  scheduler on the skipped step itself; none with a fused optimizer and ``lr_on_skip="advance"``,
  or without such a scheduler. On CUDA the fused step's flag is not read: it is copied to the host
  behind the step (a device-to-host copy, counted in place of that read) and checked as the next
  step starts, so a fused step adds no host read there.
- host-to-device copies of CPU tensors and tensors made from Python data: none added (a pageable
  copy waits for the stream; a non-blocking one from pinned memory does not, and is not counted; on
  a CPU machine only the tensors made from Python data can show).

On a GPU only the ops that touch a tensor on it (or make one there) are counted: an op on CPU
tensors is host work, not a launch.

For fp16, Lightning's ``MixedPrecision`` drives ``torch.amp.GradScaler``: that is torch's recipe.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.kernels import _triton

BATCH = 3  # counted: after the first batches, which create the scale, the flags and the optimizer state
EXTRA_OPS = 6  # the guard's budget of aten ops per batch over MixedPrecision's


class StepCost(TorchDispatchMode):
    """Counts aten ops, gradient passes, host reads and host-to-device copies while ``active``."""

    def __init__(self, params: list[nn.Parameter], device: str) -> None:
        super().__init__()
        self.params = params
        self.device_type = torch.device(device).type
        self.active = False
        self.ops: Counter[str] = Counter()
        self.views = 0
        self.passes: Counter[int] = Counter()  # gradient storage -> reads + writes
        self.scalar_reads = self.host_reads = self.to_host = self.host_to_device = self.from_python = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.active and func.namespace == "aten" and self._on_device(args, kwargs):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _on_device(self, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether an op touches the device (on a GPU: host work on CPU tensors launches nothing)."""
        if self.device_type == "cpu":
            return True
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == self.device_type:
            return True
        leaves = tree_flatten((args, kwargs))[0]
        return any(isinstance(t, Tensor) and t.device.type == self.device_type for t in leaves)

    def _count(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        self.views += view
        if name == "_local_scalar_dense":  # a read of a pinned host copy waits for nothing
            self.scalar_reads += 1
            self.host_reads += args[0].device.type == self.device_type
        self.from_python += name in ("lift_fresh", "lift_fresh_copy", "scalar_tensor")
        if name in ("_to_copy", "copy_"):
            src, dst = (args[0], kwargs.get("device")) if name == "_to_copy" else (args[1], args[0].device)
            if isinstance(src, Tensor) and dst is not None:
                on_host = src.device.type == "cpu", torch.device(dst).type == "cpu"
                # A non-blocking copy from pinned memory does not wait for the stream.
                waits = not (src.is_pinned() and kwargs.get("non_blocking", len(args) > 2 and args[2]))
                self.host_to_device += on_host == (True, False) and waits
                self.to_host += on_host == (False, True)
        if view:
            return  # a view reads nothing
        grads = self._grad_storages()
        for index, arg in enumerate(schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            touched = {
                t.untyped_storage().data_ptr() for t in tree_flatten(value)[0] if isinstance(t, Tensor)
            }
            for ptr in touched & grads:
                self.passes[ptr] += 2 if written else 1

    def triton_read(self, group: list[Tensor]) -> None:
        """The Triton norm kernel's launch, which no dispatch mode sees: one op and one read of ``group``."""
        if not self.active:
            return
        self.ops["triton_sum_of_squares"] += 1
        for ptr in {t.untyped_storage().data_ptr() for t in group} & self._grad_storages():
            self.passes[ptr] += 1

    def _grad_storages(self) -> set[int]:
        return {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}

    @property
    def total(self) -> int:
        """Aten ops but the scalar reads and the copies to the host, which have a bound of their own."""
        return sum(self.ops.values()) - self.scalar_reads - self.to_host

    @property
    def grad_passes(self) -> int:
        """Passes over the gradients: the most any one gradient tensor was read or written."""
        return max(self.passes.values(), default=0)


class _Window(Callback):
    def __init__(self, mode: StepCost) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.mode.active = batch_idx == BATCH

    def on_train_batch_end(self, trainer: Trainer, module: Any, out: Any, batch: Any, batch_idx: int) -> None:
        self.mode.active = False


class _BackwardWindow(_Window):
    """Counts from the loss's creation to ``on_after_backward``: its scaling and its backward.

    (``MixedPrecision`` scales the loss before the ``on_before_backward`` hooks, ``AMPPrecision`` after.)
    """

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        module.loss_made = lambda: setattr(self.mode, "active", batch_idx == BATCH)

    def on_after_backward(self, trainer: Trainer, module: Any) -> None:
        self.mode.active = False


class _Model(LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.fused = fused

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.loss_made()
        return loss

    def loss_made(self) -> None:
        """Called as the loss is made (a window may start counting there)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _FusedClipping(MixedPrecision):
    """Lightning's MixedPrecision without its refusal to clip for a fused optimizer (bf16 scales nothing)."""

    def clip_gradients(
        self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = "norm"
    ) -> None:
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def _cost(
    plugin: Any, device: str, fused: bool, clip: float | None, window: type[_Window] = _Window
) -> StepCost:
    model = _Model(fused)
    mode = StepCost(list(model.parameters()), device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((BATCH + 2) * 4, 8, generator=g)
    trainer = Trainer(
        accelerator=device, devices=1, max_steps=BATCH + 2, plugins=[plugin], callbacks=[window(mode)],
        gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    kernel = _triton.sum_of_squares

    def counted(group: list[Tensor]) -> Tensor:
        mode.triton_read(group)
        return kernel(group)

    with mode, pytest.MonkeyPatch.context() as patch:
        patch.setattr(_triton, "sum_of_squares", counted)
        trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    assert mode.total, "the counted batch did not run"
    return mode


def _diff(ours: StepCost, theirs: StepCost) -> str:
    names = sorted(set(ours.ops) | set(theirs.ops))
    rows = [f"{n}: {theirs.ops[n]} -> {ours.ops[n]}" for n in names if ours.ops[n] != theirs.ops[n]]
    launches = f"{theirs.total - theirs.views} -> {ours.total - ours.views} launches"
    passes = f"{theirs.grad_passes} -> {ours.grad_passes} passes over the gradients"
    return f"{theirs.total} -> {ours.total} aten ops, {launches}, {passes} ({', '.join(rows)})"


CASES = [
    # precision, fused AdamW, gradient_clip_val, extra passes over the gradients, extra host reads,
    # and lr_on_skip="hold" (the default) unless the id says "advance"
    pytest.param("bf16-mixed", True, None, 1, 1, id="bf16-fused"),
    pytest.param(
        "bf16-mixed", True, None, 1, 0, id="bf16-fused-advance"
    ),  # no read: a guard alone syncs nothing
    pytest.param("bf16-mixed", False, None, 1, 1, id="bf16-nonfused"),
    pytest.param("bf16-mixed", False, 1.0, 0, 1, id="bf16-nonfused-clip"),
    pytest.param("bf16-mixed", True, 1.0, 0, 1, id="bf16-fused-clip"),
    pytest.param("16-mixed", False, 1.0, -2, 0, id="fp16-nonfused-clip"),  # GradScaler reads once too
    pytest.param("16-mixed", True, None, -1, 1, id="fp16-fused"),
]


@pytest.mark.parametrize(("precision", "fused", "clip", "passes", "reads"), CASES)
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_guarded_batch_costs_a_handful_of_ops_over_mixed_precision(
    request: pytest.FixtureRequest,
    device: str,
    precision: str,
    fused: bool,
    clip: float | None,
    passes: int,
    reads: int,
) -> None:
    fp16 = precision == "16-mixed"
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if fp16 else None
    lightning = _FusedClipping if fused and clip else MixedPrecision
    theirs = _cost(lightning(precision, device=device, scaler=scaler), device, fused, clip)  # type: ignore[arg-type]
    lr_on_skip = "advance" if "advance" in request.node.callspec.id else "hold"
    ours_scaler = LossScaler(init_scale=2.0**8) if fp16 else None
    plugin = AMPPrecision(precision, device=device, scaler=ours_scaler, lr_on_skip=lr_on_skip)  # type: ignore[arg-type]
    ours = _cost(plugin, device, fused, clip)
    print(_diff(ours, theirs))
    assert ours.total <= theirs.total + EXTRA_OPS, _diff(ours, theirs)
    assert ours.grad_passes - theirs.grad_passes == passes, (ours.passes, theirs.passes)
    # The skip's reader reads the flag at once or, on CUDA for a fused step, copies it behind the step.
    assert ours.host_reads + ours.to_host - theirs.host_reads - theirs.to_host == reads, _diff(ours, theirs)
    if device == "cuda" and fused:
        assert ours.host_reads == theirs.host_reads, _diff(ours, theirs)  # no wait for the GPU added
    assert ours.host_to_device <= theirs.host_to_device, _diff(ours, theirs)
    assert ours.from_python <= theirs.from_python, _diff(ours, theirs)


@pytest.mark.parametrize(("precision", "fewer"), [("16-mixed", 2), ("bf16-mixed", 0)])
@pytest.mark.filterwarnings("ignore:.*emulates.*")
def test_the_guarded_backward_takes_fewer_ops_than_a_scaled_loss(
    device: str, precision: str, fewer: int
) -> None:
    """Backward starts from the scaler's seed (``scale + 0 * loss``: one launch, which also makes an
    inf/NaN loss skip its step), where a scaled loss takes three (its product, the ones autograd
    starts from, and the product's backward); a guard's seed stands in for autograd's ones."""
    fp16 = precision == "16-mixed"
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if fp16 else None
    lightning = MixedPrecision(precision, device=device, scaler=scaler)  # type: ignore[arg-type]
    theirs = _cost(lightning, device, False, None, _BackwardWindow)
    plugin = AMPPrecision(precision, device=device, scaler=LossScaler(init_scale=2.0**8) if fp16 else None)  # type: ignore[arg-type]
    ours = _cost(plugin, device, False, None, _BackwardWindow)
    assert ours.total - ours.views <= theirs.total - theirs.views - fewer, _diff(ours, theirs)
