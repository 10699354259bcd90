"""Run as a script by tests/unit/lightning/test_fsdp.py: Lightning's ModelParallelStrategy (FSDP2) on 2 CPUs.

Lightning launches the second process by re-running this script, so it cannot run inside pytest.
Usage: python _model_parallel_fit.py OUT_DIR PRECISION [monitor|policy|castfirst]
("monitor": a non-fused AdamW and a LossScaleMonitor, whose forensics read the poisoned step's gradients;
"policy": fully_shard with a bf16 MixedPrecisionPolicy, its fp32 shards the masters; "castfirst": the
model cast to bf16 before fully_shard, for a "-true" precision)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision, LossScaleMonitor, LossScaler
from amp_plugin.diagnostics import nonfinite_gradients
from tests._ranks import skip_teardown_at_exit

POISON_STEP = 2


class Sharded(LightningModule):
    def __init__(self, out_dir: str, poison: bool, fused: bool = True, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.out_dir, self.poison, self.fused, self.norms = out_dir, poison, fused, []
        self.forensics: list[list[str]] = []  # what nonfinite_gradients named, per step, on this rank

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.variant == "castfirst":  # half weights: cast before sharding (after it, cast_model refuses)
            self.to(torch.bfloat16)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": policy} if self.variant == "policy" else {}
        for layer in (self.net[0], self.net[2], self.net):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"], **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.poison and self.global_rank == 1 and self.global_step == POISON_STEP:
            self.net[2].weight.grad.to_local().view(-1)[0] = float("inf")  # rank 1's shard only

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.fused:  # a collective: every rank calls it at every step
            self.forensics.append([str(g) for g in nonfinite_gradients(self)])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.norms.append(float(self.trainer.precision_plugin.last_grad_norm))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)

    def on_train_end(self) -> None:
        flat = torch.cat([p.full_tensor().detach().flatten() for p in self.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        scaler = self.trainer.precision_plugin.scaler
        result = {
            "param_type": type(self.net[2].weight).__name__,
            "param_dtype": str(self.net[2].weight.dtype),
            "norms": self.norms,
            "skipped": None if scaler is None else scaler.skipped_steps,
            "scale": None if scaler is None else scaler.get_scale(),
            "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
            "params_finite": bool(torch.isfinite(flat).all()),
            "forensics": self.forensics,
        }
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(result))


def main(out_dir: str, precision: str, variant: str = "") -> None:
    torch.set_num_threads(1)
    scaler = LossScaler("cpu", init_scale=1024.0) if precision == "16-mixed" else None
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 3, generator=g))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy,
        plugins=[AMPPrecision(precision, scaler=scaler)], max_steps=5, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[LossScaleMonitor(warmup_steps=0)] if variant == "monitor" else [],  # report the first skip
    )  # fmt: skip
    model = Sharded(out_dir, poison=scaler is not None, fused=variant != "monitor", variant=variant)
    trainer.fit(model, DataLoader(data, batch_size=4))
    # Leave the group together while both ranks are alive: gloo torn down at interpreter exit, after
    # the other rank has gone, can abort ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    skip_teardown_at_exit()


if __name__ == "__main__":
    main(*sys.argv[1:])
