"""DTensor gradients (torch's ``fully_shard``, FSDP2): kernels on local shards, norms across shards.

Under ``torch.distributed.fsdp.fully_shard`` every parameter and gradient is a ``DTensor``
whose local part is this rank's shard (``Shard(0)``). Running the scaler's kernels on the
``DTensor`` itself would go through DTensor's dispatch, where the inf check of each
``(device, dtype)`` group hides its own all-reduce and a norm fails on the sharded
dimension. :class:`ShardAwareKernels` runs the kernels on the local shards instead: the
unscale and multiply touch only this rank's elements, the inf flag stays local until the
scaler agrees on it across ranks (one all-reduce, ``LossScaler(sync_found_inf=...)``), and
the norm sums the local shards' contributions over the mesh dimensions the tensors are
sharded on, so that it is the norm of the whole model on every rank.

Plain tensors pass through unchanged, unless they are themselves one rank's shard of the
gradients (FSDP1, ZeRO: ``ShardAwareKernels(kernels, sharded=True)``): then their norm is
reduced over the process group too. Nothing here imports ``torch.distributed.tensor``: a
process that never imported it holds no DTensor.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from amp_plugin._distributed import check_group, global_norm
from amp_plugin._validation import fail
from amp_plugin.kernels import Kernels

__all__ = ["ShardAwareKernels", "has_dtensor", "local_shards", "shard_groups"]


_DTENSOR: list[type] = []  # DTensor, once torch.distributed.tensor has been imported (by anyone)


def _dtensor_type() -> type | None:
    if _DTENSOR:
        return _DTENSOR[0]
    found = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if found is not None:
        _DTENSOR.append(found)
    return found


def has_dtensor(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor`` (cheap when ``torch.distributed.tensor`` is unused).

    Example:
        >>> has_dtensor([torch.zeros(2)])
        False
    """
    dtensor = _dtensor_type()
    return dtensor is not None and any([isinstance(t, dtensor) for t in tensors])


def local_shards(tensors: Sequence[Tensor]) -> list[Tensor]:
    """This rank's part of each tensor: ``to_local()`` for a ``DTensor``, the tensor itself otherwise.

    The local shard shares storage with the ``DTensor``, so in-place kernels on it change
    the ``DTensor``.

    Example:
        >>> t = torch.ones(2)
        >>> local_shards([t])[0] is t
        True
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(tensors)
    return [cast(Any, t).to_local() if isinstance(t, dtensor) else t for t in tensors]


def shard_groups(tensor: Tensor) -> tuple[Any, ...]:
    """The process groups over which ``tensor``'s elements are split (empty for a plain tensor).

    One group per mesh dimension with a ``Shard`` placement; ``Replicate`` dimensions hold
    copies and add nothing. A ``Partial`` placement (a sum not yet reduced) is refused.

    Example:
        >>> shard_groups(torch.zeros(2))
        ()
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return ()
    dt: Any = tensor
    groups = []
    for dim, placement in enumerate(dt.placements):
        if placement.is_partial():
            fail(
                "ShardAwareKernels",
                passed=f"a gradient with placements {dt.placements}",
                why="a Partial gradient is not reduced yet",
                allowed="Shard or Replicate placements",
                hint="reduce the gradients (fully_shard does) before unscaling or clipping them.",
            )
        if placement.is_shard():
            groups.append(dt.device_mesh.get_group(dim))
    return tuple(groups)


class ShardAwareKernels:
    """A kernel backend that runs on the local shards of ``DTensor`` gradients.

    ``unscale_`` and ``mul_`` act on each rank's shard (the inf flag is this rank's; the
    scaler all-reduces it before any skip decision). ``norm`` is the norm of the whole
    tensors: each set of tensors sharded over the same groups contributes its local norm
    reduced over those groups (:func:`~amp_plugin._distributed.global_norm`, one collective
    of one element per group), and the contributions combine as the wrapped backend
    combines its ``(device, dtype)`` groups. Lists without a ``DTensor`` go straight to the
    wrapped backend, so results on plain tensors are bit-identical to it.

    With ``sharded=True`` plain tensors are this rank's shard of gradients split over ``group``
    (FSDP1, ZeRO; ``LossScaler.clip_grad_norm_(..., sharded=True)``): their norm is reduced over
    ``group`` (``None``: the default group), so the norm, the clip factor and the inf flag
    derived from it are the same on every rank.

    Example:
        >>> from amp_plugin.kernels import get_kernels
        >>> k = ShardAwareKernels(get_kernels("torch"))
        >>> k.name, k.norm([torch.tensor([3.0, 4.0])]).item()
        ('torch', 5.0)
    """

    def __init__(self, kernels: Kernels, *, sharded: bool = False, group: Any = None) -> None:
        if not all(callable(getattr(kernels, op, None)) for op in ("unscale_", "norm", "mul_")):
            fail(
                "ShardAwareKernels",
                passed=f"kernels={kernels!r:.80}",
                allowed="a kernel backend (unscale_, norm and mul_)",
                hint="pass amp_plugin.get_kernels('auto').",
                error=TypeError,
            )
        self.inner = kernels
        self.name = kernels.name
        self.sharded = sharded
        self.group = check_group(group, "ShardAwareKernels")

    def unscale_(self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
        self.inner.unscale_(local_shards(tensors), inv_scale, found_inf)

    def mul_(self, tensors: Sequence[Tensor], factor: Tensor) -> None:
        self.inner.mul_(local_shards(tensors), factor)

    def norm(self, tensors: Sequence[Tensor], norm_type: float = 2.0, exact: bool = False) -> Tensor:
        if not has_dtensor(tensors):
            norm = self.inner.norm(tensors, norm_type, exact)
            return global_norm(norm, norm_type, self.group) if self.sharded else norm
        by_groups: dict[tuple[Any, ...], list[Tensor]] = {}
        for tensor in tensors:
            by_groups.setdefault(shard_groups(tensor), []).append(tensor)
        partial = []
        for groups, members in by_groups.items():  # first-seen order: the same on every rank
            norm = self.inner.norm(local_shards(members), norm_type, exact)
            for group in groups:
                norm = global_norm(norm, norm_type, group)
            partial.append(norm)
        if len(partial) == 1:
            return partial[0]
        device = partial[0].device
        total: Tensor = torch.linalg.vector_norm(torch.stack([p.to(device) for p in partial]), norm_type)
        return total
