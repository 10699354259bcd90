"""Run one loop under ``torch.amp.GradScaler`` and under ``LossScaler``; compare them bit for bit.

The conformance and property tests share this: scaler factories, a model whose parameters
can be poisoned at chosen places, per-step snapshots of parameters and optimizer state, and
a comparison that reports the first tensor whose bits differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from amp_plugin import LossScaler

Scaler = Any  # a torch.amp.GradScaler or an amp_plugin.LossScaler
OptFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptFactory] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}
POISONS = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
WHERE = ("first", "middle", "last")


def grad_scaler(device: str = "cpu", **kwargs: Any) -> torch.amp.GradScaler:
    """The oracle: torch's scaler on ``device`` (its kernels are that device's arithmetic)."""
    return torch.amp.GradScaler(device, **kwargs)


def loss_scaler(device: str = "cpu", **kwargs: Any) -> LossScaler:
    """``LossScaler(device=device, **kwargs)``."""
    return LossScaler(device=device, **kwargs)


def mlp(seed: int = 0, width: int = 7, device: str = "cpu") -> nn.Sequential:
    """Three linear layers (six parameters): first = weight 0, middle = weight 1, last = bias 2.

    Initialised on the CPU from ``seed`` and then moved, so every device starts from the same weights.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    ).to(device)


def data(steps: int, micro: int = 1, seed: int = 1, batch: int = 4, device: str = "cpu") -> Tensor:
    """Inputs of shape (steps, micro, batch, 5) on ``device``, independent of the global RNG."""
    x = torch.randn(steps, micro, batch, 5, generator=torch.Generator().manual_seed(seed))
    return x.to(device)


def poison(params: Sequence[nn.Parameter], where: str, value: float) -> None:
    """Write ``value`` into one gradient element of the first, middle or last parameter."""
    index = {"first": 0, "middle": len(params) // 2, "last": len(params) - 1}[where]
    grad = params[index].grad
    assert grad is not None
    flat = (grad._values() if grad.is_sparse else grad).view(-1)
    with torch.no_grad():
        flat[flat.numel() // 2] = value


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        value = value.detach()
        return (value.to_dense() if value.is_sparse else value).clone()
    return value


def snapshot(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """Every parameter of ``optimizer`` and every entry of its state, named, copied."""
    out: list[tuple[str, Any]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out.append((f"group{g}.param{i}", _clone(p)))
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                out.append((f"group{g}.param{i}.{key}", _clone(value)))
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Equal bit for bit (NaN equals NaN with the same payload); containers item by item."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    return bool(a == b)


def assert_same_snapshots(a: list[tuple[str, Any]], b: list[tuple[str, Any]], what: str = "") -> None:
    assert [n for n, _ in a] == [n for n, _ in b], f"{what}: different optimizer state keys"
    for (name, x), (_, y) in zip(a, b, strict=True):
        if not same_bits(x, y):
            detail = ""
            if isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape:
                detail = f" (max |diff| {(x.double() - y.double()).abs().max().item():.3g})"
            raise AssertionError(f"{what}: {name} differs{detail}:\n{x}\nvs\n{y}")


@dataclass
class Trace:
    """What one arm did: per iteration the scale after update(), per optimizer the skips, the states."""

    scales: list[float] = field(default_factory=list)
    skipped: list[tuple[bool, ...]] = field(default_factory=list)
    states: list[list[list[tuple[str, Any]]]] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)  # anything else a scenario wants compared

    def close(
        self, scaler: Scaler, optimizers: Sequence[torch.optim.Optimizer], skipped: Sequence[bool]
    ) -> None:
        """Record the end of an iteration (call after update())."""
        self.scales.append(scaler.get_scale())
        self.skipped.append(tuple(skipped))
        self.states.append([snapshot(o) for o in optimizers])


def step(scaler: Scaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
    """``scaler.step(optimizer)``; True when the step was skipped.

    Skipped means: no parameter and no existing state entry changed, and state that a fused
    optimizer creates on its first (skipped) step has a step counter of zero.
    """
    before = dict(snapshot(optimizer))
    scaler.step(optimizer, *args, **kwargs)
    after = dict(snapshot(optimizer))
    for name, value in after.items():
        if name in before:
            if not same_bits(before[name], value):
                return False
        elif name.endswith(".step") and float(value) != 0.0:
            return False
    return True


def assert_same_traces(theirs: Trace, ours: Trace) -> None:
    """``ours`` (LossScaler) took exactly the steps of ``theirs`` (GradScaler), bit for bit."""
    assert ours.scales == theirs.scales, "scale after each update()"
    assert ours.skipped == theirs.skipped, "skipped steps (per iteration, per optimizer)"
    assert len(ours.states) == len(theirs.states)
    for it, (a, b) in enumerate(zip(theirs.states, ours.states, strict=True)):
        for k, (sa, sb) in enumerate(zip(a, b, strict=True)):
            assert_same_snapshots(sa, sb, f"iteration {it}, optimizer {k}")
    assert len(ours.extra) == len(theirs.extra)
    for x, y in zip(theirs.extra, ours.extra, strict=True):
        assert same_bits(x, y), f"{x!r} != {y!r}"


def run_twins(
    loop: Callable[[Scaler, str], Trace], device: str = "cpu", **scaler_kwargs: Any
) -> tuple[Trace, Trace]:
    """Run ``loop(scaler, arm)`` with GradScaler and with LossScaler on ``device``; assert equal traces."""
    theirs = loop(grad_scaler(device, **scaler_kwargs), "torch")
    ours = loop(loss_scaler(device, **scaler_kwargs), "ours")
    assert_same_traces(theirs, ours)
    return theirs, ours
