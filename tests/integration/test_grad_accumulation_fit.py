"""Trainer.fit with ``accumulate_grad_batches``: half-weight precisions add micro-batches up in fp32."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from amp_plugin import AMPPrecision

MICRO = 8  # micro-batches per optimizer step: a power of two, so Lightning's loss / MICRO is exact


def _micro_gradients() -> Tensor:
    """8 gradient rows: the first in [1, 2), the other 7 in [2**-10, 2**-9): 2**10 apart, bf16 values."""
    g = torch.Generator().manual_seed(3)
    rows = 1 + torch.rand(MICRO, 64, generator=g)
    rows[1:] *= 2.0**-10
    return rows.bfloat16().float()  # exact in bf16 and fp16: the cast of the inputs changes nothing


class Probe(L.LightningModule):
    """``loss = sum(w * g_k)``: micro-batch ``k``'s gradient of ``w`` is ``g_k / MICRO``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))
        self.seen: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (g,) = batch
        return (self.w * g[0]).float().sum()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        (param,) = optimizer.param_groups[0]["params"]  # the master with O2, ``w`` itself with "-true"
        self.seen.append(param.grad.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "bf16-true"},
        {"precision": "bf16-mixed", "master_weights": True},
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-mixed", "master_weights": "remainder"},
    ],
    ids=["bf16-true", "O2-bf16", "O2-fp16", "remainder"],
)
def test_accumulated_gradient_is_the_fp32_sum(kwargs: dict[str, Any]) -> None:
    rows = _micro_gradients()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=1)
    module = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[AMPPrecision(**kwargs)], logger=False,
                        max_epochs=1, accumulate_grad_batches=MICRO, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    (grad,) = module.seen
    reference = rows.double().sum(0) / MICRO  # fp64: exact for these 8 rows
    if grad.dtype == torch.float32:  # O2: the masters' gradient is the fp32 sum itself
        assert torch.allclose(grad.double(), reference, rtol=MICRO * 2.0**-24, atol=0)
    else:  # "-true": the fp32 sum, rounded once into the bf16 .grad
        assert torch.equal(grad, reference.to(grad.dtype))
    # What adding up in the half .grad gives: the small micro-batches are lost (the test is not vacuous).
    half = torch.float16 if kwargs["precision"].startswith("16") else torch.bfloat16
    naive = (rows / MICRO).to(half)[0].clone()
    for row in (rows / MICRO).to(half)[1:]:
        naive += row
    assert not torch.allclose(naive.double(), reference, rtol=MICRO * 2.0**-24, atol=0)


class Poisoned(L.LightningModule):
    """A regressor whose micro-batch ``poison`` returns an inf loss."""

    def __init__(self, poison: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison = poison

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        return loss * float("inf") if batch_idx == self.poison else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _regression(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )


def _skips(kwargs: dict[str, Any], poison: int) -> tuple[int, int, Poisoned]:
    module, plugin = Poisoned(poison), AMPPrecision(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, max_epochs=1,
                        accumulate_grad_batches=2, gradient_clip_val=0.5, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _regression())
    assert plugin.guard is not None
    return plugin.guard.total_steps, plugin.guard.skipped_steps, module


@pytest.mark.parametrize(
    "kwargs",
    [{"precision": "bf16-true"}, {"precision": "16-mixed", "master_weights": True}],
    ids=["bf16-true", "O2-fp16"],
)
def test_the_guard_skips_one_poisoned_window_and_clipping_runs(kwargs: dict[str, Any]) -> None:
    clean_steps, clean_skips, _ = _skips(kwargs, poison=-1)
    steps, skips, module = _skips(kwargs, poison=3)  # the 2nd window's last micro-batch
    # One more window skipped (fp16's scaler may skip warm-up steps in both runs); had the inf
    # stayed in an fp32 sum, every later window would be skipped too.
    assert steps == clean_steps == 8 and skips == clean_skips + 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize(
    "kwargs",
    [{"precision": "bf16-true"}, {"precision": "16-mixed", "master_weights": True}],
    ids=["bf16-true", "O2-fp16"],
)
def test_under_ddp_the_step_sees_the_fp32_sum(kwargs: dict[str, Any]) -> None:
    """DDP reduces the fp32 sums at the last micro-batch (a comm hook) instead of the half ``.grad``."""
    rows = _micro_gradients()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=1)
    module = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", plugins=[AMPPrecision(**kwargs)],
                        logger=False, max_epochs=1, accumulate_grad_batches=MICRO, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader)
    finally:  # one in-process rank: the process group it made must not outlive the test
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    (grad,) = module.seen
    reference = rows.double().sum(0) / MICRO
    if grad.dtype == torch.float32:
        assert torch.allclose(grad.double(), reference, rtol=MICRO * 2.0**-24, atol=0)
    else:
        assert torch.equal(grad, reference.to(grad.dtype))


@pytest.mark.parametrize("case", ["gradient_as_bucket_view", "comm hook"])
def test_off_under_ddp_where_it_cannot_work_warns(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``gradient_as_bucket_view`` the ``.grad`` is DDP's bucket; DDP takes one comm hook only."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from amp_plugin.grad_accumulation import Fp32GradAccumulation

    if case == "comm hook":  # as Lightning's DDPStrategy(ddp_comm_hook=...) registers one on CUDA
        ours = Fp32GradAccumulation.reduce_across

        def hooked_first(self: Fp32GradAccumulation, ddp: Any) -> None:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            ours(self, ddp)

        monkeypatch.setattr(Fp32GradAccumulation, "reduce_across", hooked_first)
    strategy = DDPStrategy(gradient_as_bucket_view=case == "gradient_as_bucket_view")
    module, plugin = Poisoned(poison=-1), AMPPrecision("bf16-true")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin], logger=False,
                        max_steps=2, accumulate_grad_batches=2, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    named = "DDPStrategy" if case == "gradient_as_bucket_view" else "with a comm hook"
    try:
        with pytest.warns(UserWarning, match=f"fp32 gradient accumulation is off under .*{named}"):
            trainer.fit(module, _regression())
    finally:  # one in-process rank: the process group it made must not outlive the test
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_turned_off_it_adds_up_in_the_half_grad_and_a_non_bool_is_refused() -> None:
    rows = _micro_gradients()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=1)
    module = Probe()
    plugin = AMPPrecision("bf16-true", fp32_grad_accumulation=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, max_epochs=1,
                        accumulate_grad_batches=MICRO, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    naive = (rows / MICRO).bfloat16()[0].clone()
    for row in (rows / MICRO).bfloat16()[1:]:
        naive += row
    assert torch.equal(module.seen[0], naive)  # torch's own accumulation, as before
    with pytest.raises(TypeError, match=r"fp32_grad_accumulation='no'.*True or False.*HINT"):
        AMPPrecision("bf16-true", fp32_grad_accumulation="no")  # type: ignore[arg-type]
