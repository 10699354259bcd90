"""Train the quickstart transformer with several processes (DDP) and ``AMPPrecision``.

Every rank must take the same skip decision, or the replicas drift apart for good.
``LossScaler`` all-reduces its inf flag before each decision (``sync_found_inf="auto"``),
and at the end this script checks, across ranks, that the scale, the scaler's trackers and
a checksum of the parameters agree (``amp_plugin.consistency.check_consistency``).

Run::

    python examples/ddp.py --devices 2                         # 2 CPU processes (gloo)
    python examples/ddp.py --devices 2 --precision 16-mixed    # fp16 + loss scaling
    python examples/ddp.py --accelerator gpu --devices 4       # 4 GPUs (nccl)

``--strategy ddp`` (the default) re-launches this script once per extra process, which is
also how torchrun and SLURM start it (see docs/distributed.md). ``ddp_spawn`` forks from
this process instead; it sends no training state back, so the summary is printed by rank 0.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from quickstart import Config, MajorityTransformer, make_dataset, progress, quiet_lightning
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision, LossScaleMonitor
from amp_plugin.consistency import check_consistency


class RankSummary(Callback):
    """Times the run, checks that the ranks agree, and prints a summary on rank 0."""

    def __init__(self) -> None:
        self.start = 0.0
        self.samples = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.samples += len(batch[0]) * trainer.world_size

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, AMPPrecision)
        check_consistency(plugin.scaler, pl_module)  # a collective: every rank takes part
        if not trainer.is_global_zero:
            return
        elapsed = time.perf_counter() - self.start
        scaler = plugin.scaler
        did = (
            f"scale {scaler.get_scale():g}, skipped {scaler.skipped_steps} of {scaler.total_steps} steps"
            if scaler is not None
            else "no loss scaling needed for bf16"
        )
        print(f"\nprecision     {plugin.precision} on {trainer.world_size} x {plugin.device}")
        print(f"steps         {trainer.global_step} ({self.samples / elapsed:,.0f} samples/s across ranks)")
        print(f"train loss    {float(getattr(pl_module, 'last_loss', float('nan'))):.4f} (rank 0)")
        print(f"loss scaler   {did}")
        agreed = "parameter checksum" if scaler is None else "scale, scaler trackers and parameter checksum"
        print(f"ranks agree   {agreed} identical on every rank (check_consistency)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default: cpu)")
    parser.add_argument(
        "--strategy", choices=("ddp", "ddp_spawn"), default="ddp",
        help="ddp re-launches this script per extra process; ddp_spawn forks from it (default: ddp)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=("auto", "bf16-mixed", "16-mixed"), default="auto",
        help="AMPPrecision's precision (default: auto, bf16 on CPU)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default: 60)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a small model, for tests")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config, steps = Config(), args.max_steps
    if args.smoke:
        config, steps = Config(d_model=64, train_samples=512, val_samples=128), min(steps, 6)
    quiet_lightning()
    # The example trains only: Lightning's note that validation_step has no val_dataloader says nothing new.
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
    seed_everything(0, verbose=False)
    torch.set_num_threads(max(1, torch.get_num_threads() // args.devices))  # processes share the cores
    model = MajorityTransformer(config, total_steps=steps)
    train = DataLoader(make_dataset(config.train_samples, seed=1), batch_size=config.batch_size, shuffle=True)
    bar, lines = progress(every=max(1, steps // 6))
    trainer = Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, max_steps=steps,
        plugins=[AMPPrecision(args.precision)], callbacks=[LossScaleMonitor(), RankSummary(), *lines],
        gradient_clip_val=1.0, logger=CSVLogger("runs", name="ddp"), log_every_n_steps=min(10, steps),
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=bar, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, train)
    # Leave the process group together, while every rank is alive: a rank whose gloo group is torn
    # down at interpreter exit, after another rank has gone, can abort ("terminate called without an
    # active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
