"""All ranks take the same skip decision.

Under data parallelism every rank must skip the same steps, or the replicas diverge for
good. Gradients are usually all-reduced before the inf check, but not always (hooks that
change gradients after the all-reduce, sharded gradients, fused optimizers that decide
inside their kernel), so the inf flag itself is all-reduced (MAX) before any skip decision.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SyncMode", "all_reduce_found_inf", "check_sync_mode", "sync_enabled"]

SyncMode = Literal["auto"] | bool


def check_sync_mode(mode: object) -> SyncMode:
    """Validate ``sync_found_inf``; raise ``ValueError`` naming the allowed values."""
    if mode not in ("auto", True, False) or (mode != "auto" and not isinstance(mode, bool)):
        raise ValueError(
            f"sync_found_inf={mode!r} is not allowed; use 'auto', True or False. HINT: 'auto' "
            "all-reduces the inf flag whenever torch.distributed runs with more than one process."
        )
    return mode


def sync_enabled(mode: SyncMode, group: Any = None) -> bool:
    """Whether the inf flag must be all-reduced across ``group`` under ``mode``."""
    if mode is False:
        return False
    ready = dist.is_available() and dist.is_initialized()
    if mode is True and not ready:
        raise RuntimeError(
            "sync_found_inf=True but torch.distributed is not initialised. HINT: call "
            "torch.distributed.init_process_group() first, or use sync_found_inf='auto'."
        )
    return ready and dist.get_world_size(group) > 1


def all_reduce_found_inf(found_inf: Tensor, group: Any = None) -> Tensor:
    """All-reduce the inf flag with MAX across ``group``, in place, without a host sync.

    NCCL reduces only CUDA tensors, so a flag held elsewhere travels through the
    backend's device and back.
    """
    backend = dist.get_backend(group)
    if backend == "nccl" and found_inf.device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        staged = found_inf.to(device)
        dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(staged)
    else:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
