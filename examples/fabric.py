"""Lightning Fabric with amp_plugin's fp16 loss scaling: your own loop, ``AMPPrecision`` underneath.

A small MLP learns a regression with large targets in fp16 on CPU, in a plain Fabric loop:
``fabric.backward``, ``fabric.clip_gradients`` (which sees the unscaled gradients and returns
their norm), ``optimizer.step()`` (skipped when a gradient overflowed). Halfway through, the
state is saved with ``fabric.save`` (the plugin itself is in the state, so the loss scale is
too), and a second Fabric loads it and runs the second half again: the two finish with the
same weights, bit for bit.

Run::

    python examples/fabric.py
    python examples/fabric.py --smoke   # a short run, for tests
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from quickstart import print_key_values  # shared with the quickstart
from torch import nn

from amp_plugin import LossScaler
from amp_plugin.lightning.fabric import AMPPrecision

FEATURES = 16
MAX_NORM = 5.0


def batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ~ N(0, 1), targets of size ~20 (the first scaled gradients overflow fp16)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0)) / math.sqrt(FEATURES)
    return x, 20.0 * torch.sin(2 * x @ w)


def build(init_scale: float) -> tuple[Fabric, AMPPrecision, Any, Any]:
    precision = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler("cpu", init_scale=init_scale,
                                                                          growth_interval=20))  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, precision, model, optimizer


def train(
    fabric: Fabric, precision: AMPPrecision, model: Any, optimizer: Any, steps: range
) -> dict[str, Any]:
    losses, norms, skipped = [], [], []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        if precision.last_step_skipped:
            skipped.append(step + 1)  # counted from 1, as the other examples and the monitor do
        else:
            norms.append(float(norm))
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "skipped": skipped}


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--steps", type=int, default=400, help="training steps, half before the checkpoint (default: 400)"
    )
    parser.add_argument("--smoke", action="store_true", help="60 steps, for tests")
    args = parser.parse_args(argv)
    steps = 60 if args.smoke else args.steps
    half = steps // 2

    fabric, precision, model, optimizer = build(init_scale=2.0**16)
    first = train(fabric, precision, model, optimizer, range(half))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "checkpoint.pt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})
        second = train(fabric, precision, model, optimizer, range(half, steps))
        straight = flat(model)
        fabric2, precision2, model2, optimizer2 = build(init_scale=1.0)  # the checkpoint brings the scale
        fabric2.load(path, {"model": model2, "optimizer": optimizer2, "amp": precision2})
        resumed_scale = precision2.scaler.get_scale() if precision2.scaler is not None else 1.0
        train(fabric2, precision2, model2, optimizer2, range(half, steps))
    losses, norms = first["losses"] + second["losses"], first["norms"] + second["norms"]
    scaler = precision.scaler
    assert scaler is not None
    print_key_values("Summary", [
        ("precision", f"{precision.precision} ({precision.dtype}) with {type(scaler).__name__}"),
        ("steps", str(steps)),
        ("loss", f"{losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f} (mean of the last 5)"),
        ("skipped steps", f"{len(first['skipped']) + len(second['skipped'])} at steps "
                          f"{first['skipped'] + second['skipped']}"),
        ("grad norm", f"{norms[0]:.2f} -> {norms[-1]:.2f} (unscaled, before each clip to {MAX_NORM})"),
        ("loss scale", f"{scaler.get_scale():g} (saved after step {half}: {resumed_scale:g})"),
        ("resume", "bit-exact" if torch.equal(straight, flat(model2)) else "DIFFERS"),
    ])  # fmt: skip


if __name__ == "__main__":
    main()
