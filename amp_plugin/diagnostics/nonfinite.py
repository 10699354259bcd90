"""Which parameters' gradients hold inf/NaN, for a step that was skipped.

Plain torch: nothing here imports Lightning; nothing costs anything until it is called.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from amp_plugin._validation import check_int, fail

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

    Meant for a step that was skipped: it synchronises with the device (once per device,
    plus once per offender reported).

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
    found: list[NonFiniteGradient] = []
    for i in _suspects([grad for _, grad in named]):
        name, grad = named[i]
        n_inf, n_nan = (int(v) for v in torch.stack([grad.isinf().sum(), grad.isnan().sum()]).tolist())
        if n_inf + n_nan:
            found.append(
                NonFiniteGradient(
                    name, nonfinite_kind(n_inf > 0, n_nan > 0), n_inf + n_nan, grad.numel(), grad.dtype
                )
            )
        if len(found) == limit:
            break
    return found


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


def _suspects(grads: list[Tensor]) -> list[int]:
    by_device: dict[torch.device, list[int]] = {}
    for i, grad in enumerate(grads):
        by_device.setdefault(grad.device, []).append(i)
    suspects: list[int] = []
    for indices in by_device.values():
        # The 1-norm is one fused pass that propagates inf and NaN (one host sync per device). A huge
        # finite gradient can overflow it too, so the caller confirms every suspect exactly.
        norms = torch._foreach_norm([grads[i] for i in indices], 1, dtype=torch.float32)
        flags = (~torch.isfinite(torch.stack(norms))).tolist()
        suspects += [i for i, bad in zip(indices, flags, strict=True) if bad]
    return sorted(suspects)
