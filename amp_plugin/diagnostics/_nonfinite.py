"""Which parameters' gradients hold inf/NaN, for a step that was skipped.

Plain torch: nothing here imports Lightning; nothing costs anything until it is called.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from amp_plugin._sharding import local_shards, shard_groups
from amp_plugin._validation import check_int, fail
from amp_plugin.kernels._base import per_tensor_norms

__all__ = ["NonFiniteGradient", "dtype_name", "nonfinite_gradients", "nonfinite_kind"]


def nonfinite_kind(has_inf: bool, has_nan: bool) -> str:
    """``"inf"``, ``"nan"`` or ``"inf and nan"``: the words for what a tensor holds.

    Example:
        >>> nonfinite_kind(True, False), nonfinite_kind(True, True)
        ('inf', 'inf and nan')
    """
    return "inf and nan" if has_inf and has_nan else ("inf" if has_inf else "nan")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name without the ``torch.`` prefix, for a message.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class NonFiniteGradient:
    """A parameter whose gradient holds inf/NaN; ``str()`` gives a one-line description.

    Example:
        >>> str(NonFiniteGradient("head.bias", "nan", 1, 4, torch.float16))
        'head.bias (nan in 1 of 4 values, float16)'
    """

    name: str
    kind: str  # "inf", "nan" or "inf and nan"
    count: int  # how many of the gradient's values are non-finite
    numel: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.name} ({self.kind} in {self.count} of {self.numel} values, {dtype_name(self.dtype)})"


def nonfinite_gradients(
    named_parameters: Iterable[tuple[str, Tensor]] | nn.Module, limit: int = 5
) -> list[NonFiniteGradient]:
    """Name the parameters whose ``.grad`` holds inf or NaN, in parameter order.

    Meant for a step that was skipped: it synchronises with the device twice per device (one
    read finds the suspects, one more counts their inf and NaN values exactly).

    Sharded gradients (``DTensor``, torch's ``fully_shard``) are read on this rank's shard and
    the results summed over the ranks the gradient is split across, so every rank names the same
    parameters with the counts of the whole gradient, whichever rank's shard went non-finite.
    That takes two all-reduces per device and sharding, so every rank of the mesh must call it
    (as with any collective).

    Args:
        named_parameters: ``model.named_parameters()`` (or the model itself).
        limit: report at most this many parameters.

    Raises:
        TypeError: ``named_parameters`` is not a module or ``(name, tensor)`` pairs (plain
            ``model.parameters()`` included), or ``limit`` is not an int.
        ValueError: ``limit`` is below 1.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> model.bias.grad[0] = float("nan")
        >>> [str(g) for g in nonfinite_gradients(model)]
        ['bias (nan in 1 of 2 values, float32)']
    """
    check_int("nonfinite_gradients", "limit", limit, low=1, hint="pass limit=5 to name five parameters.")
    pairs = _named_pairs(named_parameters)
    named = [
        (n, p.grad.coalesce().values() if p.grad.is_sparse else p.grad)
        for n, p in pairs
        if p.grad is not None
    ]
    counts = _nonfinite_counts([grad for _, grad in named])
    found = []
    for i in sorted(counts)[:limit]:
        (name, grad), (n_inf, n_nan) = named[i], counts[i]
        kind = nonfinite_kind(n_inf > 0, n_nan > 0)
        found.append(NonFiniteGradient(name, kind, n_inf + n_nan, grad.numel(), grad.dtype))
    return found


def _nonfinite_counts(grads: list[Tensor]) -> dict[int, tuple[int, int]]:
    """``{index: (inf count, nan count)}`` of the gradients that hold any, summed over their shards."""
    layouts: dict[tuple[torch.device, tuple[Any, ...]], list[int]] = {}
    for i, grad in enumerate(grads):  # parameter order: the same layouts, in the same order, on every rank
        layouts.setdefault((grad.device, shard_groups(grad)), []).append(i)
    counts: dict[int, tuple[int, int]] = {}
    for (_, groups), indices in layouts.items():
        local = local_shards([grads[i] for i in indices])
        # The 1-norm is one fused pass that propagates inf and NaN. A huge finite gradient can overflow
        # it too (and so can the sum over shards), so every suspect is confirmed by an exact count.
        norms = _summed(torch.stack(per_tensor_norms(local, 1)), groups)
        suspects = [j for j, bad in enumerate((~torch.isfinite(norms)).tolist()) if bad]
        if not suspects:
            continue
        found = torch.stack([torch.stack([local[j].isinf().sum(), local[j].isnan().sum()]) for j in suspects])
        for j, (n_inf, n_nan) in zip(suspects, _summed(found, groups).tolist(), strict=True):
            if n_inf or n_nan:
                counts[indices[j]] = (int(n_inf), int(n_nan))
    return counts


def _summed(tensor: Tensor, groups: tuple[Any, ...]) -> Tensor:
    """``tensor`` summed over every process group a sharded gradient is split across (in place)."""
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _named_pairs(named_parameters: object) -> list[tuple[str, Tensor]]:
    if isinstance(named_parameters, nn.Module):
        return list(named_parameters.named_parameters())
    allowed, hint = (
        "a module or (name, parameter) pairs",
        "pass model.named_parameters() or the model itself.",
    )
    shown = f"{named_parameters!r:.60}" if isinstance(named_parameters, (str, int, float)) else "..."
    if isinstance(named_parameters, (str, bytes)) or not isinstance(named_parameters, Iterable):
        fail(
            "nonfinite_gradients",
            passed=f"named_parameters={shown}",
            allowed=allowed,
            hint=hint,
            error=TypeError,
        )
    pairs = list(named_parameters)
    for item in pairs:  # plain parameters would unpack into rows and silently report nothing
        ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
        if not (ok and isinstance(item[1], Tensor)):
            got = f"{type(item).__name__} {item!r:.60}" if not isinstance(item, Tensor) else "a bare tensor"
            fail(
                "nonfinite_gradients",
                passed=f"named_parameters={shown}",
                allowed=allowed + f"; got {got}",
                hint=hint,
                error=TypeError,
            )
    return pairs
