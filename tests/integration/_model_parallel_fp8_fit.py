"""Run as a script by tests/integration/test_fp8_fsdp.py: fp8 under Lightning's ModelParallelStrategy (FSDP2).

The LightningModule converts its layers to fp8 in ``configure_model`` before ``fully_shard``, with the
spec it hands ``AMPPrecision(fp8=...)``; at ``POISON_STEP`` an inf lands in rank 1's shard only.
Lightning launches the second process by re-running this script, so it cannot run inside pytest.
Usage: python _model_parallel_fp8_fit.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision
from amp_plugin.fp8 import Float8, convert, float8_layer_names
from tests._fp8_models import TinyLM, batches, lm_loss

POISON_STEP = 2
SPEC = Float8(min_features=64)


class ShardedLM(LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM()
        self.out_dir = out_dir
        self.skipped: list[bool] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        convert(self, SPEC)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return lm_loss(self.model, tokens[self.global_rank :: 2], targets[self.global_rank :: 2])

    def on_after_backward(self) -> None:
        if self.global_rank == 1 and self.global_step == POISON_STEP:
            self.model.blocks[0].fc1.weight.grad.to_local().view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.skipped.append(self.trainer.precision_plugin.last_step_skipped)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_end(self) -> None:
        flat = torch.cat([p.full_tensor().detach().flatten() for p in self.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        plugin = self.trainer.precision_plugin
        result = {
            "fp8_layers": len(float8_layer_names(self)),
            "reported": list(plugin.fp8_report.converted_names),
            "skipped": self.skipped,
            "guard_skipped": plugin.guard.skipped_steps,
            "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
            "params_finite": bool(torch.isfinite(flat).all()),
        }
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(result))


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[AMPPrecision("bf16-mixed", fp8=SPEC)],
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(ShardedLM(out_dir), DataLoader(batches(4), batch_size=None))
    if dist.is_initialized():  # leave the group together (see tests/unit/lightning/_model_parallel_fit.py)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
