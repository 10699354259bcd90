"""AMPPrecision under Lightning's DDP on CPU (gloo, 2 processes): every rank takes the same decisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaler

RANK1_POISON = (2, 5)  # steps at which only rank 1 sees an inf, after DDP's all-reduce

pytestmark = pytest.mark.forks  # every test here starts its ranks with ddp_fork


class _RankModule(LightningModule):
    def __init__(self, out_dir: str, poison: tuple[int, ...] = RANK1_POISON) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out_dir, self.poison = out_dir, poison
        self.dtypes: list[str] = []
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.dtypes.append(str(out.dtype))
        return nn.functional.mse_loss(out.float(), y)

    def on_after_backward(self) -> None:
        if self.global_rank == 1 and self.global_step in self.poison:
            self.net[2].bias.grad.fill_(float("inf"))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.scales.append(self.trainer.precision_plugin.guard.get_scale())

    def on_train_end(self) -> None:
        flat = torch.cat([p.detach().flatten() for p in self.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)  # compared inside the workers: they return nothing
        scaler = self.trainer.precision_plugin.guard  # the fp16 scaler itself, or bf16's guard
        result = {
            "dtypes": sorted(set(self.dtypes)),
            "steps": len(self.dtypes),
            "scales": self.scales,
            "skipped": scaler.skipped_steps,
            "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
            "params_finite": bool(torch.isfinite(flat).all()),
            "sync": scaler.process_group is None,
        }
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(result))

    def configure_optimizers(self) -> Any:
        if getattr(self, "optimizer", None) == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        fused = getattr(self, "optimizer", None) == "fused"
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(plugin: AMPPrecision, root: Path, max_steps: int) -> Trainer:
    # ddp_fork (no interpreter shutdown in the workers, where gloo's teardown can abort now and then)
    # sends no loop or scaler state back to this process (Lightning 2.6), so the
    # checkpoint is written inside the workers.
    return Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=max_steps, plugins=[plugin],
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, save_top_k=0)],
    )  # fmt: skip


def _results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ddp_ranks_agree_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    plugin = AMPPrecision("16-mixed", scaler=LossScaler(init_scale=2.0**8, growth_interval=4))
    trainer = _trainer(plugin, tmp_path, max_steps=8)
    trainer.fit(_RankModule(str(out)), _loader())
    r0, r1 = _results(out)
    assert r0["dtypes"] == r1["dtypes"] == ["torch.float16"]  # every step under fp16 autocast
    assert r0["steps"] == r1["steps"] == 8
    assert r0["scales"] == r1["scales"]
    assert r0["skipped"] == r1["skipped"] >= len(RANK1_POISON)  # rank 0 skipped too: it saw no inf
    assert r0["params_equal_across_ranks"]

    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["amp_plugin"]["scaler"]["skipped_steps"] == r0["skipped"]
    resumed_out = tmp_path / "resumed"
    resumed_out.mkdir()
    plugin2 = AMPPrecision("16-mixed", scaler=LossScaler(init_scale=2.0**8, growth_interval=4))
    _trainer(plugin2, tmp_path, max_steps=12).fit(
        _RankModule(str(resumed_out)), _loader(), ckpt_path=str(ckpt)
    )
    s0, s1 = _results(resumed_out)
    assert s0["steps"] == s1["steps"] == 4  # the 4 steps after the checkpoint
    assert s0["skipped"] == s1["skipped"] >= r0["skipped"]  # counters continued from the checkpoint
    assert s0["scales"] == s1["scales"]
    assert s0["params_equal_across_ranks"]


class _HookNanModule(_RankModule):
    """Only rank 1's on_before_optimizer_step writes a NaN, after the plugin has unscaled."""

    def on_after_backward(self) -> None:
        pass

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_rank == 1 and self.global_step == 1:
            self.net[0].weight.grad[0, 0] = float("nan")


def test_nan_from_a_hook_on_one_rank_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """The plugin's re-check after the hooks is agreed across ranks (ddp_fork: no re-import, fast)."""
    plugin = AMPPrecision("16-mixed", scaler=LossScaler(init_scale=2.0**8, growth_interval=1000))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=3, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(_HookNanModule(str(tmp_path)), _loader())
    r0, r1 = _results(tmp_path)
    assert r0["skipped"] == r1["skipped"] == 1  # rank 0 saw no NaN and skipped too
    assert r0["scales"] == r1["scales"] == [2.0**8, 2.0**7, 2.0**7]
    assert r0["params_equal_across_ranks"] and r0["params_finite"]


@pytest.mark.parametrize(
    ("precision", "optimizer"), [("bf16-mixed", "sgd"), ("bf16-mixed", "fused"), ("32-true", "sgd")]
)
def test_a_guarded_inf_on_one_rank_is_skipped_on_every_rank(
    tmp_path: Path, precision: str, optimizer: str
) -> None:
    """bf16 and fp32 have no loss scaler; the guard still agrees on the skip across ranks (ddp_fork)."""
    plugin = AMPPrecision(precision)  # type: ignore[arg-type]
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=4, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    module = _RankModule(str(tmp_path), poison=(2,))
    module.optimizer = optimizer
    trainer.fit(module, _loader())
    r0, r1 = _results(tmp_path)
    dtype = "torch.bfloat16" if precision == "bf16-mixed" else "torch.float32"
    assert r0["dtypes"] == r1["dtypes"] == [dtype]
    assert r0["skipped"] == r1["skipped"] == 1  # rank 0 saw no inf and skipped too
    assert r0["params_equal_across_ranks"] and r0["params_finite"]


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_true_with_a_rounding_keeps_the_ranks_equal(tmp_path: Path, rounding: str) -> None:
    """The rounded step leaves DDP's all-reduce hooks in place: every step's gradients are averaged."""
    plugin = AMPPrecision("bf16-true", rounding=rounding)  # type: ignore[arg-type]
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=6, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    module = _RankModule(str(tmp_path), poison=(2,))
    module.optimizer = "sgd"
    trainer.fit(module, _loader())
    r0, r1 = _results(tmp_path)
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["params_equal_across_ranks"] and r0["params_finite"]
