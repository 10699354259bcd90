"""A pure-torch test double of Apex's ``amp_C`` and ``apex.multi_tensor_apply.multi_tensor_applier``.

It implements the ``amp_C`` kernels that ``amp_plugin/kernels/_apex.py`` calls, with the argument
rules of Apex's sources, on any device, CPU included, so the real
:class:`~amp_plugin.kernels._apex.ApexKernels` dispatch code runs without CUDA or Apex:

- ``noop_flag`` is an int32 tensor of at least one element; a kernel only ever sets element 0
  to 1 and never resets it.
- A launch takes lists that are all non-empty and of equal length, whose tensors share the flag's
  device, are contiguous (or channels-last contiguous), are not zero-numel, have one dtype per
  list, and have equal numel at each index across lists. Real ``amp_C`` crashes, hangs or
  silently misreads memory on some of these; the double raises ``RuntimeError`` on all of them,
  so that a dispatch mistake fails a test instead of passing it.
- Scalars are Python numbers. Real ``amp_C`` would accept a tensor through ``__float__`` at the
  cost of a device-to-host sync; the double raises ``TypeError`` to catch that.
- ``multi_tensor_scale`` computes in fp32, rounds once, and flags non-finite inputs.
  ``multi_tensor_l2norm`` / ``multi_tensor_l2norm_scale`` sum squares per chunk in fp32 and flag a
  chunk whose sum is non-finite; they return ``(total fp32 [1], per-tensor fp32 [n] or [0])``.
  ``multi_tensor_l2norm_scale`` measures its *inputs*.

Not modelled: real ``amp_C`` is built with ``--use_fast_math`` and flushes fp32/bf16 subnormals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CHUNK_SIZE",
    "MultiTensorApply",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_scale",
    "multi_tensor_scale",
    "update_scale_hysteresis",
]

#: The chunk length Apex's ``multi_tensor_applier`` passes to every kernel.
CHUNK_SIZE = 2048 * 32

_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
_FP32_FP16 = frozenset({torch.float32, torch.float16})

TensorLists = Sequence[Sequence[Tensor]]


class MultiTensorApply:
    """Double of ``apex.multi_tensor_apply.MultiTensorApply``; records the name of every op it launches."""

    available = True

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self.calls: list[str] = []

    def __call__(
        self, op: Callable[..., Any], noop_flag: Tensor, tensor_lists: TensorLists, *args: Any
    ) -> Any:
        self.calls.append(op.__name__)
        return op(self.chunk_size, noop_flag, tensor_lists, *args)


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out = in * scale`` in fp32, rounded once; flags a non-finite input."""
    _check_launch("multi_tensor_scale", noop_flag, tensor_lists, depth=2, dtypes=(_FLOATS, _FLOATS))
    factor = torch.tensor(_number("scale", scale), dtype=torch.float32, device=noop_flag.device)
    with torch.no_grad():
        for src, dst in zip(*tensor_lists, strict=True):
            value = src.float()
            _set_flag(noop_flag, ~torch.isfinite(value).all())
            dst.copy_(value * factor)


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 L2 norm of all tensors (and of each when ``per_tensor``); flags a non-finite chunk sum."""
    _check_launch("multi_tensor_l2norm", noop_flag, tensor_lists, depth=1, dtypes=(_FLOATS,))
    with torch.no_grad():
        return _l2norm(chunk_size, noop_flag, tensor_lists[0], _flag_arg(per_tensor))


def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """``out = in * scale`` like ``multi_tensor_scale``, returning the norm of the inputs in one pass."""
    _check_launch(
        "multi_tensor_l2norm_scale", noop_flag, tensor_lists, depth=2, dtypes=(_FP32_FP16, _FP32_FP16)
    )
    factor = torch.tensor(_number("scale", scale), dtype=torch.float32, device=noop_flag.device)
    with torch.no_grad():
        norms = _l2norm(chunk_size, noop_flag, tensor_lists[0], _flag_arg(per_tensor))
        for src, dst in zip(*tensor_lists, strict=True):
            dst.copy_(src.float() * factor)
    return norms


def update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> Tensor:
    """Apex's hysteresis update: back off once the overflow budget runs out; a clean step refills it."""
    if current_scale.dtype != torch.float32 or found_inf.dtype != torch.float32:
        raise RuntimeError("update_scale_hysteresis: current_scale and found_inf must be fp32")
    if growth_tracker.dtype != torch.int32 or hysteresis_tracker.dtype != torch.int32:
        raise RuntimeError("update_scale_hysteresis: growth_tracker and hysteresis_tracker must be int32")
    # A one-thread kernel on the device; host reads are fine in a double.
    inf = found_inf.item() > 0
    if inf:
        hysteresis_tracker.sub_(1)
        if hysteresis_tracker.item() > 0:
            growth_tracker.zero_()
            return current_scale
    if inf:
        # float * double in double, stored as float: one rounding, as in the kernel.
        current_scale.fill_(current_scale.item() * backoff_factor)
        growth_tracker.zero_()
    else:
        successful = int(growth_tracker.item()) + 1
        if successful == growth_interval:
            grown = torch.tensor(current_scale.item() * growth_factor, dtype=torch.float32)
            if torch.isfinite(grown):
                current_scale.copy_(grown)
            growth_tracker.zero_()
        else:
            growth_tracker.fill_(successful)
        hysteresis_tracker.fill_(hysteresis)
    return current_scale


def _l2norm(
    chunk_size: int, noop_flag: Tensor, tensors: Sequence[Tensor], per_tensor: bool
) -> tuple[Tensor, Tensor]:
    chunk_sums = [_chunk_sums(tensor, chunk_size) for tensor in tensors]
    for sums in chunk_sums:
        _set_flag(noop_flag, ~torch.isfinite(sums).all())
    total = torch.cat(chunk_sums).sum().sqrt().reshape(1)
    if per_tensor:
        return total, torch.stack([sums.sum().sqrt() for sums in chunk_sums])
    return total, torch.empty(0, dtype=torch.float32, device=noop_flag.device)


def _chunk_sums(tensor: Tensor, chunk_size: int) -> Tensor:
    """Sum of squares of each ``chunk_size`` slice, in fp32: what one kernel block accumulates."""
    flat = tensor.reshape(-1).float()
    return torch.stack([chunk.square().sum() for chunk in flat.split(chunk_size)])


def _set_flag(noop_flag: Tensor, condition: Tensor) -> None:
    # Only ever 1, never 0: the caller zeroes the flag (no host read of the condition either).
    noop_flag[:1].masked_fill_(condition, 1)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"amp_C double: {name}={value!r} ({type(value).__name__}) is not a Python number; amp_C takes "
            "a C float. HINT: passing a tensor would make pybind11 read it on the host, a device sync."
        )
    return float(value)


def _flag_arg(per_tensor: object) -> bool:
    if per_tensor is not None and not isinstance(per_tensor, bool):
        raise TypeError(f"amp_C double: per_tensor={per_tensor!r} must be a bool or None")
    return bool(per_tensor)


def _check_launch(
    op: str,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    depth: int,
    dtypes: tuple[frozenset[torch.dtype], ...],
) -> None:
    """Raise ``RuntimeError`` on any launch real ``amp_C`` would reject, crash on, or misread."""
    if noop_flag.dtype != torch.int32 or noop_flag.numel() < 1:
        raise RuntimeError(
            f"{op}: noop_flag must be an int32 tensor with >= 1 element, got {noop_flag.dtype}"
        )
    if len(tensor_lists) != depth:
        raise RuntimeError(f"{op}: expected {depth} tensor lists, got {len(tensor_lists)}")
    first = tensor_lists[0]
    if not first:
        raise RuntimeError(f"{op}: tensor_lists[0] is empty; amp_C needs at least one tensor per launch")
    for index, (tensors, allowed) in enumerate(zip(tensor_lists, dtypes, strict=True)):
        if len(tensors) != len(first):
            raise RuntimeError(f"{op}: list {index} has {len(tensors)} tensors, list 0 has {len(first)}")
        list_dtypes = {tensor.dtype for tensor in tensors}
        if len(list_dtypes) != 1:
            raise RuntimeError(
                f"{op}: list {index} mixes dtypes {sorted(map(str, list_dtypes))}; amp_C reads all as one"
            )
        if tensors[0].dtype not in allowed:
            raise RuntimeError(
                f"{op}: list {index} has dtype {tensors[0].dtype}; amp_C supports {sorted(map(str, allowed))}"
            )
        for position, tensor in enumerate(tensors):
            _check_tensor(
                op, f"list {index} tensor {position}", tensor, noop_flag.device, first[position].numel()
            )


def _check_tensor(op: str, where: str, tensor: Tensor, device: torch.device, numel: int) -> None:
    if tensor.device != device:
        raise RuntimeError(
            f"{op}: {where} is on {tensor.device}, the noop_flag on {device}; one device per launch"
        )
    if not (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)):
        raise RuntimeError(f"{op}: {where} is not contiguous")
    if tensor.numel() == 0:
        raise RuntimeError(
            f"{op}: {where} has zero elements; amp_C skips launching the chunks queued before it"
        )
    if tensor.numel() != numel:
        raise RuntimeError(f"{op}: {where} has {tensor.numel()} elements, list 0 has {numel} at that index")
