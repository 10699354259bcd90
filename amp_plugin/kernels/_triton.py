"""The fp32 sum of squares of many CUDA tensors in one Triton launch: the scaled gradients' 2-norm.

Why not ``torch._foreach_norm``: its multi-tensor launcher (and Apex's ``multi_tensor_l2norm``) hands
a launch at most 320 chunks of 65536 elements, so 400M gradients take 19 launches, each ending in
a tail where the GPU is partly idle. On an H200 that read of 1.6 GB took 0.65 ms, where a copy
moved 3.2 GB in 0.95 ms; this kernel took 0.44 ms (docs/kernels.md, "The CUDA norm kernel").
Here every chunk of every tensor is one program of a single launch: a table of chunk addresses and
lengths (built on the host, cached by the tensors' addresses, sent with a non-blocking copy from
pinned memory, so nothing waits for the GPU) is all the kernel reads besides the gradients. Each
program sums its chunk's squares in fp32 across ``_BLOCK`` lanes; ``torch.sum`` then adds the
per-chunk sums: a fixed order, and a smaller rounding error than one fp32 sum per tensor. Any inf
or NaN element makes its square, and so the sum, inf or NaN.

Used by both backends' ``norm(exact=False)`` for fp32/fp16/bf16 groups of CUDA tensors that are
contiguous (or channels-last contiguous) when Triton imports, outside ``torch.compile`` tracing and
CUDA graph capture; anything else takes the backend's own kernels. A new set of gradient addresses
costs a chunk table built and sent (host time only); gradients reallocated each step get the same
addresses back from the caching allocator once the steps repeat.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

__all__ = ["norm", "sum_of_squares", "usable"]

# The tiling read fastest of seven tried on an H200 (400M fp32 gradients in 100 tensors: 0.44 ms,
# against 0.49-0.54 ms for the others and 0.65 ms for torch._foreach_norm).
_CHUNK = 1 << 16  # elements per program: 256 KB of fp32
_BLOCK = 1024  # lanes per program; each sums _CHUNK / _BLOCK elements before the lanes are added
_WARPS = 4
_ALIGN = 16  # bytes: every chunk address a multiple of this lets the loads be vectorised
_PLANS = 16  # cached chunk tables (one per set of gradient addresses: a steady run reuses one)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _kernel() -> Any:
    """The compiled-on-first-launch Triton kernel, or ``None`` when Triton does not import."""
    try:
        import triton  # type: ignore[import-not-found, unused-ignore]
        import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
    except Exception:  # a missing or broken Triton means torch's ops, never an error
        return None

    @triton.jit  # type: ignore[untyped-decorator, misc, unused-ignore]
    def sum_of_squares_kernel(  # type: ignore[no-untyped-def]  # pragma: no cover - GPU (or TRITON_INTERPRET=1)
        table, chunks, first, like, out, aligned: tl.constexpr, chunk: tl.constexpr, block: tl.constexpr
    ):
        # ``table`` holds ``chunks`` addresses, then their lengths; this launch sums chunk ``first + pid``.
        at = first + tl.program_id(0)
        # ``like`` is one of the tensors: its pointer type says how to read every chunk's address.
        base = tl.load(table + at).to(tl.pointer_type(like.dtype.element_ty))
        count = tl.load(table + chunks + at)
        acc = tl.zeros((block,), dtype=tl.float32)
        lanes = tl.arange(0, block)
        if aligned:
            base = tl.multiple_of(base, 16)
        if count == chunk:
            for start in range(0, chunk, block):
                x = tl.load(base + start + lanes).to(tl.float32)
                acc += x * x
        else:
            for start in range(0, chunk, block):
                idx = start + lanes
                x = tl.load(base + idx, mask=idx < count, other=0.0).to(tl.float32)
                acc += x * x
        tl.store(out + at, tl.sum(acc, axis=0))

    return sum_of_squares_kernel


def usable(group: list[Tensor]) -> bool:
    """Whether :func:`sum_of_squares` takes ``group`` (one device and dtype, no empty tensors).

    Example:
        >>> usable([torch.ones(3)])  # a CPU tensor: torch's ops
        False
    """
    first = group[0]
    if first.device.type != "cuda" or first.dtype not in _DTYPES or torch.compiler.is_compiling():
        return False
    if first.device in _failed:
        return False
    if torch.cuda.is_current_stream_capturing():  # a CUDA graph would keep one step's chunk table
        return False
    # Dense in memory from data_ptr() on (the order of the elements does not change a sum of squares).
    if not all(t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) for t in group):
        return False
    return _kernel() is not None


class _Plan:
    """The chunk table of one list of tensors: each chunk's address and length, on the device.

    Chunks whose address is a multiple of 16 bytes come first and are launched apart from the rest
    (a tensor that is a view at an odd offset, as DDP's bucket views can be), so that one such
    tensor does not keep the others' loads from being vectorised.
    """

    def __init__(self, group: list[Tensor]) -> None:
        # Built with tensor ops on the host: a 7B-parameter group is about 100k chunks.
        bases = torch.tensor([t.data_ptr() for t in group], dtype=torch.int64)
        numels = torch.tensor([t.numel() for t in group], dtype=torch.int64)
        counts = (numels + _CHUNK - 1) // _CHUNK
        owner = torch.repeat_interleave(torch.arange(len(group)), counts)
        within = torch.arange(len(owner)) - (torch.cumsum(counts, 0) - counts)[owner]
        starts = within * _CHUNK
        ptrs = bases[owner] + starts * group[0].element_size()
        lens = torch.clamp(numels[owner] - starts, max=_CHUNK)
        misaligned = ptrs % _ALIGN != 0
        order = torch.argsort(misaligned.to(torch.int8), stable=True)
        self.chunks = len(owner)
        self.aligned = self.chunks - int(misaligned.sum())
        device = group[0].device
        table = torch.stack([ptrs[order], lens[order]])
        if device.type == "cuda":
            # Pinned: the copy does not wait for the GPU, and torch keeps the buffer until it is done.
            table = table.pin_memory()
        self.table = table.to(device, non_blocking=True)


_plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()


def _plan(group: list[Tensor]) -> _Plan:
    # Built by C-level maps: this runs on every call (100 tensors: about 14 us, against 20 us by a loop).
    addresses, sizes = tuple(map(Tensor.data_ptr, group)), tuple(map(Tensor.numel, group))
    key = (group[0].device, group[0].dtype, _CHUNK, addresses, sizes)  # a table is of one chunk size
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(group)
        if len(_plans) > _PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


_failed: set[torch.device] = set()


def norm(group: list[Tensor]) -> Tensor | None:
    """The fp32 2-norm of ``group`` from :func:`sum_of_squares` where :func:`usable`, else ``None``.

    A device where Triton cannot build or launch the kernel (a GPU its compiler does not support)
    is warned about once and left to the backend's own kernels from then on.

    Example:
        >>> norm([torch.ones(3)]) is None  # a CPU tensor: the backend's own kernels
        True
    """
    if not usable(group):
        return None
    try:
        return sum_of_squares(group).sqrt()
    except Exception as err:  # raised on the host while compiling or launching, before any result
        _failed.add(group[0].device)
        warnings.warn(
            f"amp_plugin: the Triton norm kernel failed on {group[0].device} ({type(err).__name__}: {err}); "
            "the backend's own kernels read the gradients there from now on.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def sum_of_squares(group: list[Tensor]) -> Tensor:
    """The fp32 sum of the squares of every element of ``group`` (0-dim, on the group's device).

    ``group``: non-empty contiguous CUDA tensors of one dtype (fp32, fp16 or bf16) on one device,
    none empty, as :func:`usable` accepts.
    """
    plan = _plan(group)
    first = group[0]
    partial = torch.empty(plan.chunks, dtype=torch.float32, device=first.device)
    kernel = _kernel()
    with torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext():
        # (TRITON_INTERPRET=1 runs the kernel on CPU tensors: the CPU check of the kernel itself.)
        for aligned, start, stop in ((True, 0, plan.aligned), (False, plan.aligned, plan.chunks)):
            if start < stop:  # whole tensors as arguments: no view of the table or of the output to make
                kernel[(stop - start,)](
                    plan.table, plan.chunks, start, first, partial,
                    aligned=aligned, chunk=_CHUNK, block=_BLOCK, num_warps=_WARPS,
                )  # fmt: skip
    return partial.sum()
