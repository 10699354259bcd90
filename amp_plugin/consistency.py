"""Proof that the ranks agree: the loss-scaler state and a checksum of the parameters.

Every rank should hold the same scale, trackers and step counts, and (under data
parallelism) the same parameters. :func:`check_consistency` all-gathers one small fp64
vector per rank and raises naming the ranks that disagree; :class:`ConsistencyCheck` runs
it every ``n`` steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from amp_plugin._distributed import all_gather_into, check_group, world_size
from amp_plugin._validation import check_int, fail

if TYPE_CHECKING:
    from amp_plugin._scaler import LossScaler

__all__ = ["ConsistencyCheck", "check_consistency"]

# What check_consistency gathers from every rank, in this order (fp64 each).
_FIELDS = (
    "scaler enabled",
    "scale",
    "growth tracker",
    "hysteresis tracker",
    "skipped steps",
    "total steps",
    "parameter count",
    "parameter sum",
    "parameter sum of squares",
)
_REAL_FIELDS = frozenset({"scale", "parameter sum", "parameter sum of squares"})  # the others count
_STATE_KEYS = ("scale", "_growth_tracker", "_hysteresis_tracker", "skipped_steps", "total_steps")


def check_consistency(
    scaler: LossScaler | None,
    parameters: nn.Module | Iterable[Tensor] | None = None,
    *,
    group: Any = None,
) -> None:
    """Raise if the ranks of ``group`` disagree on the loss-scaler state or the parameters.

    Every rank of ``group`` must call this at the same point (it is a collective). It
    all-gathers one small fp64 vector per rank: the scale, the growth and hysteresis
    trackers, the skipped and total step counts, and a checksum of ``parameters`` (their
    element count, fp64 sum and fp64 sum of squares, computed on their device), and
    compares them bit for bit. Cost: one pass reading the parameters, a few host syncs and
    one all-gather of 72 bytes per rank, so run it every few hundred steps, not every step.
    Without an initialised process group (or with one rank) it only validates its arguments.

    Args:
        scaler: the :class:`~amp_plugin.LossScaler` of this rank, or ``None`` to compare
            only the parameters (e.g. bf16 without loss scaling).
        parameters: a module or the parameters that every rank holds in full (replicated,
            as under DDP), or ``None`` to compare only the scaler. Sharded parameters
            (FSDP, ZeRO-3) legitimately differ across ranks: leave them out.
        group: the process group to compare across (``None``: the default group).

    Raises:
        ValueError: neither a scaler nor parameters were given.
        TypeError: ``scaler`` or ``parameters`` is not what is expected.
        RuntimeError: some ranks disagree; the message names each disagreeing quantity with
            its value on every rank.

    Example:
        >>> import torch
        >>> from amp_plugin import LossScaler
        >>> model = torch.nn.Linear(2, 1)
        >>> check_consistency(LossScaler(), model)  # one process: nothing to compare
    """
    state, params = _validated_check_args(scaler, parameters)
    check_group(group, "check_consistency")
    world = world_size(group)
    if world == 1:
        return
    local = _local_summary(state, params)
    gathered = [torch.empty_like(local) for _ in range(world)]
    all_gather_into(gathered, local, group)
    table = torch.stack([t.cpu() for t in gathered])  # [world, fields]
    bits = table.view(torch.int64)  # bit-exact comparison; equal NaNs compare equal
    ranks = [i if group is None else dist.get_global_rank(group, i) for i in range(table.shape[0])]
    differ = [k for k in range(len(_FIELDS)) if bool((bits[:, k] != bits[0, k]).any())]
    if differ:
        lines = [
            f"{_FIELDS[k]}: "
            + "; ".join(_ranks_by_value(_FIELDS[k], table[:, k].tolist(), bits[:, k].tolist(), ranks))
            for k in differ
        ]
        raise RuntimeError(
            f"check_consistency: the {len(ranks)} ranks disagree on {', '.join(_FIELDS[k] for k in differ)}:"
            "\n  " + "\n  ".join(lines) + "\n"
            "HINT: replicas must take identical steps. Keep LossScaler(sync_found_inf='auto') so that "
            "every rank skips the same steps, load the same checkpoint on every rank, never call "
            "update(new_scale=...) on some ranks only, and leave sharded parameters out of the check."
        )


class ConsistencyCheck:
    """Run :func:`check_consistency` every ``every_n_steps`` steps.

    The step number comes from the caller's loop (the same on every rank), not from a
    counter inside this object: the check is a collective, and a rank that skipped it
    while the others ran it would hang them.

    Args:
        every_n_steps: check when ``step % every_n_steps == 0`` (an int >= 1).
        group: the process group to compare across (``None``: the default group).

    Example:
        >>> import torch
        >>> from amp_plugin import LossScaler
        >>> check = ConsistencyCheck(every_n_steps=100)
        >>> model, scaler = torch.nn.Linear(2, 1), LossScaler()
        >>> [step for step in range(250) if check(step, scaler, model)]
        [0, 100, 200]
    """

    def __init__(self, every_n_steps: int, *, group: Any = None) -> None:
        hint = "the check costs one all-gather and a read of the parameters; 100-1000 is usual."
        self.every_n_steps = check_int("ConsistencyCheck", "every_n_steps", every_n_steps, low=1, hint=hint)
        self.group = check_group(group, "ConsistencyCheck")

    def __call__(
        self, step: int, scaler: LossScaler | None, parameters: nn.Module | Iterable[Tensor] | None = None
    ) -> bool:
        """Check when ``step`` is a multiple of ``every_n_steps``; return whether it was due."""
        check_int(
            "ConsistencyCheck.__call__", "step", step, low=0, hint="pass the loop's step, e.g. global_step."
        )
        if step % self.every_n_steps:
            return False
        check_consistency(scaler, parameters, group=self.group)
        return True


# -- internals -------------------------------------------------------------------------------


def _validated_check_args(scaler: Any, parameters: Any) -> tuple[dict[str, Any] | None, list[Tensor] | None]:
    if scaler is None and parameters is None:
        fail(
            "check_consistency",
            passed="scaler=None, parameters=None",
            why="with neither there is nothing to compare",
            allowed="a LossScaler, parameters, or both (with neither there is nothing to compare)",
            hint="pass the scaler and the (replicated) model.",
        )
    if scaler is not None and not callable(getattr(scaler, "state_dict", None)):
        fail(
            "check_consistency",
            passed=f"scaler={type(scaler).__qualname__}",
            allowed="a LossScaler or None",
            hint="pass the scaler that steps this rank's optimizer.",
            error=TypeError,
        )
    params = None
    if parameters is not None:
        if not isinstance(parameters, nn.Module) and (
            isinstance(parameters, (Tensor, str, type)) or not isinstance(parameters, Iterable)
        ):
            fail(
                "check_consistency",
                passed=f"parameters={parameters!r:.60}",
                allowed="a module instance or an iterable of tensors",
                hint="pass model or model.parameters().",
                error=TypeError,
            )
        items = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        wrong = [type(p).__qualname__ for p in items if not isinstance(p, Tensor)]
        if wrong:
            fail(
                "check_consistency",
                passed=f"parameters=<items of type {sorted(set(wrong))}>",
                allowed="a module or an iterable of tensors",
                hint="pass model or model.parameters().",
                error=TypeError,
            )
        params = items
    return (None if scaler is None else dict(scaler.state_dict())), params


def _local_summary(state: dict[str, Any] | None, params: list[Tensor] | None) -> Tensor:
    values = [0.0] * len(_FIELDS)
    if state:
        values[0] = 1.0
        for k, key in enumerate(_STATE_KEYS, start=1):
            values[k] = float(state.get(key, 0))
    summary = torch.tensor(values, dtype=torch.float64)
    if params:
        device = params[0].device
        with torch.no_grad():
            sums = torch.stack([p.detach().sum(dtype=torch.float64).to(device) for p in params]).sum()
            squares = torch.stack(
                [torch.linalg.vector_norm(p.detach(), dtype=torch.float64).to(device) for p in params]
            )
            checksum = torch.stack([sums, squares.square().sum()]).cpu()
        summary[6] = float(sum(p.numel() for p in params))
        summary[7:] = checksum
    return summary


def _ranks_by_value(field: str, values: list[float], bits: list[int], ranks: list[int]) -> list[str]:
    """``["1024.0 on ranks 0, 2", "512.0 on rank 1"]``: each distinct value with its ranks."""
    groups: dict[int, list[int]] = {}
    shown: dict[int, float | int] = {}
    for value, key, rank in zip(values, bits, ranks, strict=True):
        groups.setdefault(key, []).append(rank)
        shown[key] = value
    if field not in _REAL_FIELDS:
        shown = {key: int(value) for key, value in shown.items()}
    return [
        f"{shown[key]!r} on rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}"
        for key, members in groups.items()
    ]
