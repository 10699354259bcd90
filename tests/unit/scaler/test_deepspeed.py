"""LossScaler against DeepSpeed's dynamic loss-scale rule, as docs/migrate_deepspeed.md maps it.

DeepSpeed is not installed here, so its rule (``DynamicLossScaler.update_scale`` in
``deepspeed/runtime/fp16/loss_scaler.py``) is restated below as a small reference model:
scale factor 2 both ways, growth after ``loss_scale_window`` iterations since the last overflow,
``hysteresis`` overflows before a backoff, a floor at ``min_loss_scale``, and the hysteresis
budget refilled on every clean step (``consecutive_hysteresis=True``) or only when the scale
grows (``False``, DeepSpeed's default).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler


def _deepspeed_scales(
    pattern: str, scale: float, window: int, hysteresis: int, min_scale: float, consecutive: bool
) -> list[float]:
    """The scale after each iteration of ``pattern`` ('x' overflow, '.' clean) under DeepSpeed's rule."""
    budget, last_overflow, out = hysteresis, -1, []
    for it, ch in enumerate(pattern):
        if ch == "x":
            if hysteresis == 1 or budget == 1:
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            last_overflow = it
        else:
            if consecutive:
                budget = hysteresis
            if (it - last_overflow) % window == 0:
                if not consecutive:
                    budget = hysteresis
                scale *= 2
        out.append(scale)
    return out


def _loss_scaler_scales(pattern: str, **kwargs: float) -> list[float]:
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = LossScaler("cpu", **kwargs)  # type: ignore[arg-type]
    out = []
    for ch in pattern:
        scaler.scale(param.sum() + 1.0).backward()
        if ch == "x":
            param.grad.fill_(float("inf"))  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
        opt.zero_grad()
    return out


# some patterns reach the floor
@pytest.mark.filterwarnings("ignore::amp_plugin._scale_policy.ScaleFloorWarning")
@pytest.mark.parametrize("seed", range(6))
def test_loss_scaler_follows_deepspeed_with_consecutive_hysteresis(seed: int) -> None:
    rng = random.Random(seed)
    window, hysteresis = rng.choice((2, 3, 5)), rng.choice((1, 2, 3))
    pattern = "".join(rng.choice("x..") for _ in range(60))
    expected = _deepspeed_scales(pattern, 2.0**6, window, hysteresis, 4.0, consecutive=True)
    got = _loss_scaler_scales(
        pattern, init_scale=2.0**6, growth_interval=window, hysteresis=hysteresis, min_scale=4.0
    )
    assert got == expected, f"pattern {pattern}, window {window}, hysteresis {hysteresis}"


def test_deepspeeds_default_hysteresis_differs_where_the_migration_guide_says() -> None:
    """Two overflows with a clean step between: DeepSpeed's default backs off once, LossScaler not."""
    pattern = "x.x."
    deepspeed_default = _deepspeed_scales(pattern, 64.0, 1000, 2, 1.0, consecutive=False)
    assert deepspeed_default == [64, 64, 32, 32]
    got = _loss_scaler_scales(pattern, init_scale=64.0, growth_interval=1000, hysteresis=2, min_scale=1.0)
    assert got == _deepspeed_scales(pattern, 64.0, 1000, 2, 1.0, consecutive=True) == [64, 64, 64, 64]
