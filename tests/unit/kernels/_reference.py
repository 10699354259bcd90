"""The fp64 reference every kernel backend is checked against (``amp_plugin.kernels._base``'s contract).

Nothing here calls a backend or a fused torch op: products are formed in fp64, where the
product of an fp16/bf16/fp32 element and an fp32 factor is exact (at most 24 + 24 significand
bits), and rounded by :func:`round_to`, which does round-to-nearest-even in fp64 arithmetic
rather than trusting a dtype cast (torch's fp64 -> fp16 cast itself goes through fp32).

The contract computes a product "in fp32, rounded once to the tensor's dtype", so the reference
rounds the exact product to fp32 first and then to the tensor's dtype. That intermediate step
matters: for a factor of 0.1, 206 of the 63488 finite fp16 values (26 bf16 ones) differ by an
ulp from rounding the exact product straight to the dtype; for power-of-two factors and 1/3 the
two agree on every fp16/bf16 value, and for fp32 tensors they are the same rounding.
fp64 tensors are multiplied in fp64, as torch does.

The factor is read unrounded, in fp32, on every device: that is the contract (``amp_plugin.kernels._base``),
and what the backends do, routing around ``torch._foreach_mul_``'s rounding of a CUDA factor to a
half tensor's dtype. ``flush=True`` models real Apex ``amp_C`` on CUDA, built with ``--use_fast_math``:
fp32 subnormal operands and products (below 2**-126, which includes every bf16 subnormal) become a
zero of the same sign before the result is rounded to the tensor's dtype. fp16 values are never fp32
subnormals, so only a product can flush for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_SIGNIFICAND_BITS = {FP16: 11, BF16: 8, FP32: 24}


def round_to(values: Tensor, dtype: torch.dtype) -> Tensor:
    """fp64 ``values`` rounded to nearest-even in ``dtype`` (subnormals and overflow to inf included)."""
    if dtype == FP64:
        return values.clone()
    info = torch.finfo(dtype)
    magnitude = values.abs()
    _, exponent = torch.frexp(torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude)))
    exponent = torch.clamp(exponent - 1, min=round(math.log2(info.tiny)))  # subnormals share one spacing
    ulp = torch.ldexp(torch.ones_like(values), exponent - (_SIGNIFICAND_BITS[dtype] - 1))
    rounded = torch.round(values / ulp) * ulp  # exact scaling by a power of two; round() is half-to-even
    overflow = rounded.abs() > info.max
    rounded = torch.where(overflow, torch.copysign(torch.full_like(rounded, math.inf), values), rounded)
    return torch.where(torch.isfinite(values), rounded, values).to(dtype)


def flush_subnormals(values: Tensor) -> Tensor:
    """fp64 ``values``, each magnitude below fp32's smallest normal made a zero of the same sign."""
    tiny = torch.finfo(FP32).tiny
    return torch.where(values.abs() < tiny, torch.copysign(torch.zeros_like(values), values), values)


def scaled(tensor: Tensor, factor: float, flush: bool = False) -> Tensor:
    """``tensor * factor`` per the contract: fp32 math (fp64 for fp64), one rounding to the dtype.

    ``flush``: fast-math fp32 arithmetic, as in Apex ``amp_C`` on CUDA (see the module docstring).
    """
    values = tensor.detach().cpu().double()
    if tensor.dtype == FP64:
        return values * float(factor)
    if flush:
        values, factor = (
            flush_subnormals(values),
            float(flush_subnormals(torch.tensor(float(factor), dtype=FP64))),
        )
    product = round_to(values * float(factor), FP32).double()
    return round_to(flush_subnormals(product) if flush else product, tensor.dtype)


def reference_mul(tensors: Sequence[Tensor], factor: float, flush: bool = False) -> list[Tensor]:
    """What ``mul_(tensors, factor)`` leaves in ``tensors``, on the CPU."""
    return [scaled(tensor, factor, flush) for tensor in tensors]


def reference_unscale(
    tensors: Sequence[Tensor], inv_scale: float, flush: bool = False
) -> tuple[list[Tensor], float]:
    """What ``unscale_`` leaves in ``tensors``, and ``found_inf``: 1.0 iff any input element is inf or NaN."""
    nonfinite = any(not bool(torch.isfinite(tensor.detach().cpu().double()).all()) for tensor in tensors)
    return reference_mul(tensors, inv_scale, flush), float(nonfinite)


def reference_norm(tensors: Sequence[Tensor], norm_type: float) -> Tensor:
    """The fp64 ``norm_type``-norm of all elements together (inf-norm: max abs; inf and NaN propagate)."""
    flat = [tensor.detach().cpu().double().reshape(-1) for tensor in tensors]
    values = torch.cat(flat) if flat else torch.zeros(0, dtype=FP64)
    if values.isnan().any():
        return torch.tensor(math.nan, dtype=FP64)
    if norm_type == math.inf:
        return values.abs().max() if values.numel() else torch.zeros((), dtype=FP64)
    return values.abs().pow(norm_type).sum().pow(1.0 / norm_type)
