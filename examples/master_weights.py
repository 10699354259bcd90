"""Why master weights exist, and Apex's opt levels O0-O3 side by side under Lightning.

Part 1, the weight-backup effect (Micikevicius et al., 2018): a weight of 1.0 gets 200 SGD
updates of 1e-4 each. fp16's spacing just below 1.0 is 2**-11 ~ 4.9e-4, so an update of 1e-4
is rounded away when written into an fp16 weight; an fp32 master copy keeps every one of them.

Part 2: a small regression MLP trained with ``AMPPrecision.from_opt_level`` at O0 (fp32),
O1 (autocast + dynamic loss scaling), O2 (fp16 model, fp32 norms, fp32 master weights) and
O3 (pure fp16, static loss scale 1.0 as in Apex), with the same data and seed: the final loss,
the weights' dtype and the bytes the weights, gradients and optimizer state take per parameter.

    python examples/master_weights.py            # both parts (about 20 s on 2 CPU cores)
    python examples/master_weights.py --smoke    # a few steps, for the tests
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision
from amp_plugin.master_weights import cast_model

LEVELS = ("O0", "O1", "O2", "O3")


def weight_backup(steps: int) -> dict[str, float]:
    """A weight of 1.0 after ``steps`` updates of 1e-4: fp32, fp16 with a master copy, fp16 alone."""
    finals = {}
    for name, dtype, masters in (("fp32", None, False), ("fp16 + master", torch.float16, True),
                                 ("fp16 alone", torch.float16, False)):  # fmt: skip
        layer = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        master = cast_model(layer, dtype, master_weights=masters) if dtype is not None else None
        opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
        if master is not None:
            master.attach(opt)
        for _ in range(steps):
            opt.zero_grad()
            layer.weight.grad = torch.ones_like(layer.weight)  # d loss / d w = 1: an update of lr
            if master is not None:
                master.grads_to_master()
            opt.step()
        finals[name] = layer.weight.item()
    return finals


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # eps=1e-4: with O3 the AdamW state is fp16, where the default 1e-8 rounds to 0.
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-4)


def data(batches: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * 32, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=32)


def state_bytes_per_param(module: nn.Module, optimizer: torch.optim.Optimizer, plugin: AMPPrecision) -> float:
    tensors: dict[int, int] = {}
    params = list(module.parameters())
    masters = list(plugin.masters.masters()) if plugin.masters is not None else []
    for t in [*params, *masters]:
        tensors[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # A step leaves gradients of the parameters the optimizer steps (fp32 masters under O2).
    stepped = masters or params
    grad_bytes = sum(p.numel() * p.element_size() for p in stepped)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, Tensor):
                tensors[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return (sum(tensors.values()) + grad_bytes) / sum(p.numel() for p in params)


def train(level: str, epochs: int, batches: int) -> dict[str, Any]:
    module = Regressor()
    plugin = AMPPrecision.from_opt_level(level)
    trainer = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data(batches))
    tail = module.losses[-batches:]
    return {
        "level": level,
        "precision": plugin.precision,
        "weights": str(module.net[0].weight.dtype).replace("torch.", ""),
        "norms": str(module.net[1].weight.dtype).replace("torch.", ""),
        "loss": sum(tail) / len(tail),
        "bytes": state_bytes_per_param(module, trainer.optimizers[0], plugin),
        "scale": plugin.scaler.get_scale() if plugin.scaler is not None else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only (for the tests)")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default: 1, steady on a busy machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, epochs, batches = (20, 1, 4) if args.smoke else (200, 6, 16)

    finals = weight_backup(steps)
    print(f"Part 1: a weight of 1.0 after {steps} SGD updates of 1e-4 (fp32 gives {1 - steps * 1e-4:.4f})")
    for name, value in finals.items():
        print(f"  {name:<14} {value:.4f}")
    print("  fp16 alone rounds every update away (1e-4 is below half of fp16's spacing near 1.0);")
    print("  the fp32 master copy keeps them, and the fp16 weight follows it.\n")

    plural = "s" if epochs > 1 else ""
    print(f"Part 2: Apex's opt levels, a 16-64-1 MLP, AdamW, {epochs} epoch{plural} of {batches} batches")
    results = [train(level, epochs, batches) for level in LEVELS]
    print(
        f"  {'level':<5} {'precision':<9} {'weights':<8} {'norms':<8} {'loss':>8} {'B/param':>8} {'scale':>8}"
    )
    for r in results:
        scale = "-" if r["scale"] is None else f"{r['scale']:g}"
        print(f"  {r['level']:<5} {r['precision']:<9} {r['weights']:<8} {r['norms']:<8} {r['loss']:>8.4f} "
              f"{r['bytes']:>8.1f} {scale:>8}")  # fmt: skip
    base = results[0]["loss"]
    print("  loss relative to O0: " + ", ".join(f"{r['level']} {r['loss'] / base:.3f}x" for r in results[1:]))
    print("  B/param: bytes held per model parameter after a step: weights, gradients, AdamW's two moments,")
    print("  and under O2 the fp32 masters (an fp16 layer holds 2 + 4 + 4 + 8 = 18, an fp32 norm layer 16).")
    return {"weight_backup": finals, "levels": results}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    main()
