"""All ranks take the same skip decision, clip by the same norm, and can prove they agree.

Under data parallelism every rank must skip the same steps, or the replicas diverge for
good. Gradients are usually all-reduced before the inf check, but not always (hooks that
change gradients after the all-reduce, sharded gradients, fused optimizers that decide
inside their kernel), so the inf flag itself is all-reduced (MAX) before any skip decision.

When every rank holds only its shard of the gradients, the clip norm of the whole model
is reduced from the local norms (:func:`global_norm`); ``ShardAwareKernels(..., sharded=True)``
in :mod:`amp_plugin._sharding` plugs that into the clipping code. The proof that the ranks agree
(``check_consistency``, ``ConsistencyCheck``) is :mod:`amp_plugin.consistency`, which builds on this module.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from amp_plugin._validation import check_choice, fail

__all__ = [
    "SyncMode",
    "all_gather_into",
    "all_reduce_found_inf",
    "all_reduce_max_",
    "check_group",
    "check_process_group",
    "check_sync_mode",
    "checked_sync_enabled",
    "global_norm",
    "is_rank_zero",
    "sync_enabled",
    "world_size",
]

SyncMode = Literal["auto"] | bool


def check_sync_mode(mode: object, call: str = "LossScaler") -> SyncMode:
    """Validate ``sync_found_inf``: ``"auto"``, ``True`` or ``False``; else ``ValueError`` naming ``call``.

    Example:
        >>> check_sync_mode("auto"), check_sync_mode(False)
        ('auto', False)
    """
    hint = "'auto' all-reduces the inf flag whenever torch.distributed runs with more than one process."
    return check_choice(call, "sync_found_inf", mode, ("auto", True, False), hint)  # type: ignore[no-any-return]


def check_process_group(group: object, call: str) -> Any:
    """``group`` if it is ``None`` (the default group) or a ``torch.distributed.ProcessGroup``.

    ``call`` names the entry point in the message, which shows the argument as ``process_group=``.

    Raises:
        TypeError: anything else, such as the string ``"world"`` or a list of ranks.

    Example:
        >>> check_process_group(None, "LossScaler") is None
        True
    """
    return check_group(group, call, "process_group")


def check_group(group: object, call: str, name: str = "group") -> Any:
    process_group = getattr(dist, "ProcessGroup", None)  # absent from torch builds without distributed
    if group is not None and (process_group is None or not isinstance(group, process_group)):
        shown = repr(group) if isinstance(group, (str, int, float, list, tuple)) else type(group).__name__
        fail(
            call,
            passed=f"{name}={shown:.80}",
            allowed="None or a torch.distributed.ProcessGroup",
            hint=(
                "pass None for the default (world) group, or a group from torch.distributed.new_group(ranks)."
            ),
            error=TypeError,
        )
    return group


def _check_flag(call: str, name: str, value: object) -> None:
    """A one-element floating-point tensor (an inf flag or a norm); NaN and inf values are fine."""
    if not isinstance(value, Tensor):
        fail(
            call,
            passed=f"{name}={type(value).__name__}",
            allowed="a one-element floating-point tensor",
            hint="pass the tensor itself, not a Python number.",
            error=TypeError,
        )
    if value.numel() != 1 or not value.is_floating_point():
        got = f"{name}=tensor of shape {tuple(value.shape)} and {value.dtype}"
        fail(
            call,
            passed=got,
            why="it is not a one-element floating-point tensor",
            allowed="a one-element floating-point tensor",
            hint="pass the 0-dim fp32 tensor the kernels return.",
        )


def sync_enabled(mode: SyncMode, group: Any = None) -> bool:
    """Whether the inf flag must be all-reduced across ``group`` under ``mode``.

    Example:
        >>> sync_enabled("auto")  # no process group: one process has nothing to agree with
        False
    """
    check_choice("sync_enabled", "mode", mode, ("auto", True, False), "pass LossScaler's sync_found_inf.")
    check_group(group, "sync_enabled")
    return checked_sync_enabled(mode, group)


def checked_sync_enabled(mode: SyncMode, group: Any = None) -> bool:
    """:func:`sync_enabled` for arguments validated already (``LossScaler`` asks once per step).

    Example:
        >>> checked_sync_enabled(False)
        False
    """
    if mode is False:
        return False
    if mode is True and not _initialised():
        raise RuntimeError(
            "sync_found_inf=True but torch.distributed is not initialised. HINT: call "
            "torch.distributed.init_process_group() first, or use sync_found_inf='auto'."
        )
    return world_size(group) > 1


def all_reduce_found_inf(found_inf: Tensor, group: Any = None) -> Tensor:
    """All-reduce the inf flag with MAX across ``group``, in place, without a host sync.

    One collective of one fp32 element. NCCL reduces only CUDA tensors, so a flag held
    elsewhere travels through the backend's device and back. With one process (or no
    process group) there is nothing to agree with, and the flag is returned as it is.

    Example:
        >>> all_reduce_found_inf(torch.tensor(1.0))
        tensor(1.)
    """
    _check_flag("all_reduce_found_inf", "found_inf", found_inf)
    check_group(group, "all_reduce_found_inf")
    if world_size(group) == 1:
        return found_inf
    _all_reduce_(found_inf, dist.ReduceOp.MAX, group)
    return found_inf


def all_reduce_max_(values: Tensor, group: Any = None) -> Tensor:
    """All-reduce a 1-D floating-point tensor with MAX across ``group``, in place, without a host sync.

    What :class:`~amp_plugin.spike.SpikeGuard` agrees its values with (one per signal), so that
    every rank keeps the same history. One collective; with one process, nothing to do.

    Example:
        >>> all_reduce_max_(torch.tensor([1.0, 2.0]))
        tensor([1., 2.])
    """
    if not isinstance(values, Tensor) or values.dim() != 1 or not values.is_floating_point():
        fail(
            "all_reduce_max_",
            passed=f"values={type(values).__name__} {getattr(values, 'shape', '')}",
            allowed="a 1-D floating-point tensor",
            hint="pass the tensor of values to agree on.",
            error=TypeError,
        )
    check_group(group, "all_reduce_max_")
    if world_size(group) > 1:
        _all_reduce_(values, dist.ReduceOp.MAX, group)
    return values


def global_norm(local_norm: Tensor, norm_type: float = 2.0, group: Any = None) -> Tensor:
    """The ``norm_type``-norm of the gradients of all ranks, from each rank's local norm.

    For sharded gradients (every element lives on exactly one rank of ``group``):
    ``(sum_r local_r ** p) ** (1 / p)``, reduced in fp64 so that squaring a large scaled
    norm cannot overflow; MAX for ``inf``, MIN for ``-inf``, SUM for the 0-"norm" (a count).
    Any inf/NaN on any rank makes the result non-finite on every rank. One collective of
    one element; no host sync.

    Args:
        local_norm: this rank's norm (0-dim, fp32), as returned by a kernel backend.
        norm_type: the order of the norm.
        group: the process group that holds the shards (``None``: the default group).

    Returns:
        The global norm as a new fp32 0-dim tensor on ``local_norm``'s device. Without an
        initialised process group (or with one rank) this process holds every shard, and
        the result is ``local_norm`` itself.

    Example:
        >>> import torch
        >>> global_norm(torch.tensor(5.0), 2.0)  # one process: the local norm is global
        tensor(5.)
    """
    _check_flag("global_norm", "local_norm", local_norm)
    if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or math.isnan(norm_type):
        fail(
            "global_norm",
            passed=f"norm_type={norm_type!r}",
            why="it is not a norm order",
            allowed="a number, inf or -inf included",
            hint="pass the norm_type given to clip_grad_norm_, e.g. 2.0.",
            error=ValueError if isinstance(norm_type, float) else TypeError,
        )
    check_group(group, "global_norm")
    if world_size(group) == 1:
        return local_norm.detach().float().clone()
    p = float(norm_type)
    reduced = local_norm.detach().to(torch.float64)
    if p == math.inf:
        reduced = torch.nan_to_num(reduced, nan=math.inf)  # MAX need not propagate NaN
        _all_reduce_(reduced, dist.ReduceOp.MAX, group)
    elif p == -math.inf:
        reduced = torch.nan_to_num(reduced, nan=-math.inf)
        _all_reduce_(reduced, dist.ReduceOp.MIN, group)
    elif p == 0:
        _all_reduce_(reduced, dist.ReduceOp.SUM, group)
    else:
        reduced = reduced.pow(p)
        _all_reduce_(reduced, dist.ReduceOp.SUM, group)
        reduced = reduced.pow(1.0 / p)
    return reduced.float()


def is_rank_zero() -> bool:
    """Whether this process is rank zero: of the default process group, else by the ``RANK`` launchers set.

    Example:
        >>> is_rank_zero()  # one process, no process group
        True
    """
    if _initialised():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any) -> int:
    """Processes in ``group``; 1 without an initialised process group (this process holds everything)."""
    return dist.get_world_size(group) if _initialised() else 1


def _backend_device(tensor: Tensor, group: Any) -> torch.device:
    """Where ``group``'s backend can reduce ``tensor``: NCCL alone handles only CUDA tensors."""
    backend = str(dist.get_backend(group))
    if tensor.device.type != "cuda" and "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def _all_reduce_(tensor: Tensor, op: Any, group: Any) -> None:
    device = _backend_device(tensor, group)
    if device == tensor.device:
        dist.all_reduce(tensor, op=op, group=group)
    else:
        staged = tensor.to(device)
        dist.all_reduce(staged, op=op, group=group)
        tensor.copy_(staged)


def all_gather_into(out: list[Tensor], tensor: Tensor, group: Any) -> None:
    device = _backend_device(tensor, group)
    staged = [t.to(device) for t in out]
    dist.all_gather(staged, tensor.to(device), group=group)
    for target, source in zip(out, staged, strict=True):
        target.copy_(source)
