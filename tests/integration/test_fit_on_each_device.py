"""One ``Trainer.fit`` per precision on each device (the ``device`` fixture: cpu, plus cuda where present).

The oracle is the same training written out in plain torch on the same device, so it computes
with that device's kernels: autocast on the device in the precision's dtype (the "-true"
precisions also hold the weights and the inputs in it), the loss scaled by a power of two for
fp16 and divided back out (exact, short of overflow), a step skipped when a gradient is not
finite (every precision is guarded; an fp16 skip halves the scale), AdamW otherwise. The fit
must train on the device and end with the same weights bit for bit, of the precision's dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler

STEPS, POISON_STEP, INIT_SCALE = 6, 3, 2.0**10
PRECISIONS = {
    "16-mixed": (torch.float16, torch.float32),  # (autocast dtype, weight dtype)
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-true": (torch.float16, torch.float16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "32-true": (torch.float32, torch.float32),
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _loader() -> DataLoader:
    x = torch.randn(STEPS * 4, 8, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x).float(), y.float())


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)  # an eps that fp16 state can hold ("16-true")


def _poison(net: nn.Module) -> None:
    net[2].weight.grad[0, 3] = float("inf")


class _Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained_on = {p.device.type for p in self.parameters()}
        return _loss(self.net, *batch)

    def on_after_backward(self) -> None:
        if self.global_step == POISON_STEP:
            _poison(self.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _adamw(self.parameters())


def _fit(precision: str, device: str) -> tuple[_Module, AMPPrecision]:
    scaler = LossScaler(device, init_scale=INIT_SCALE) if PRECISIONS[precision][0] == torch.float16 else None
    plugin = AMPPrecision(precision, device=device, scaler=scaler)  # type: ignore[arg-type]
    module = _Module()
    trainer = Trainer(
        accelerator=device, devices=1, max_steps=STEPS, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader())
    return module, plugin


def _oracle(precision: str, device: str) -> tuple[nn.Module, list[bool]]:
    dtype, weights = PRECISIONS[precision]
    net = _net().to(device, weights)
    opt = _adamw(net.parameters())
    scale = INIT_SCALE if dtype == torch.float16 else 1.0
    skipped = []
    for step, (x, y) in enumerate(_loader()):
        x, y = x.to(device, weights), y.to(device, weights)  # the "-true" inputs take the weights' dtype
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            loss = _loss(net, x, y)
        (loss * scale).backward()
        if step == POISON_STEP:
            _poison(net)
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        skipped.append(not finite)
        if finite:
            for g in grads:
                g.mul_(1.0 / scale)  # a power of two: exact
            opt.step()
        elif dtype == torch.float16:
            scale *= 0.5
        opt.zero_grad()
    return net, skipped


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fit_matches_the_same_steps_in_plain_torch_on_the_device(precision: str, device: str) -> None:
    module, plugin = _fit(precision, device)
    net, skipped = _oracle(precision, device)
    assert plugin.guard is not None and plugin.guard.skipped_steps == sum(skipped) >= 1
    assert skipped[POISON_STEP]
    assert module.trained_on == {device}  # Lightning moves the module back to the CPU after the fit
    for (name, ours), theirs in zip(module.net.named_parameters(), net.parameters(), strict=True):
        assert ours.dtype == PRECISIONS[precision][1], name
        assert torch.equal(ours, theirs.cpu()), name
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
