"""Tests for ``amp_plugin.kernels._foreach``, the torch backend: its CUDA routes, its exact and fast norms."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from amp_plugin.kernels import get_kernels
from amp_plugin.kernels._foreach import TorchKernels
from tests.fakes.cuda_rules import cuda_rules_on_cpu
from tests.unit.kernels._tensors import (
    BF16,
    CPU,
    FP16,
    MIXES,
    NONFINITE,
    assert_bit_identical,
    clone,
    make_grads,
)

# --- the CUDA routes, run on CPU under CUDA's rules (tests/fakes/cuda_rules.py) -------------------


def test_the_stand_in_follows_cudas_rules() -> None:
    """No bf16 unscale op; a 0-dim fp32 factor on the device rounded to bf16 (the H200 gave -101.5)."""
    grads, exact = [torch.tensor([-1012.0], dtype=BF16)], [torch.tensor([-1012.0], dtype=BF16)]
    with cuda_rules_on_cpu():
        with pytest.raises(NotImplementedError, match="_cuda\" not implemented for 'BFloat16'"):
            torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), torch.ones(()))
        torch._foreach_mul_(grads, torch.tensor(0.1))
    torch._foreach_mul_(exact, torch.tensor(0.1))
    assert (grads[0].item(), exact[0].item()) == (-101.5, -101.0)


def _with_odd_shapes(grads: list[Tensor]) -> list[Tensor]:
    """``grads`` plus, per dtype, a 0-dim tensor and a transposed (non-contiguous) one."""
    dtypes = dict.fromkeys(grad.dtype for grad in grads)
    extra = [
        t.to(dtype) for dtype in dtypes for t in (torch.tensor(-7.25), torch.arange(24.0).view(6, 4).t())
    ]
    return grads + extra


@pytest.mark.parametrize("factor", [0.1, 1 / 3, 2.0**-16, 3.0, 2.0**-130], ids=str)
@pytest.mark.parametrize(("where", "value"), NONFINITE)
@pytest.mark.parametrize("mix", MIXES)
def test_cuda_routes_give_the_cpu_routes_bits_and_flags(
    mix: str, where: str | None, value: float | None, factor: float
) -> None:
    grads = _with_odd_shapes(make_grads(MIXES[mix], CPU, where, value))
    kernels = TorchKernels()
    cpu_unscaled, cpu_multiplied, cpu_inf = clone(grads), clone(grads), torch.zeros(())
    kernels.unscale_(cpu_unscaled, torch.tensor(factor), cpu_inf)
    kernels.mul_(cpu_multiplied, torch.tensor(factor))
    unscaled, multiplied, found_inf = clone(grads), clone(grads), torch.zeros(())
    with cuda_rules_on_cpu():
        kernels.unscale_(unscaled, torch.tensor(factor), found_inf)
        kernels.mul_(multiplied, torch.tensor(factor))
    assert_bit_identical(unscaled, cpu_unscaled)
    assert_bit_identical(multiplied, cpu_multiplied)
    assert found_inf.item() == cpu_inf.item() == (0.0 if where is None else 1.0)


def test_cuda_route_never_resets_found_inf() -> None:
    found_inf = torch.ones(())
    with cuda_rules_on_cpu():
        TorchKernels().unscale_([torch.ones(3, dtype=BF16)], torch.tensor(0.5), found_inf)
    assert found_inf.item() == 1.0


class _AtenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _aten_ops() -> Iterator[list[str]]:
    with _AtenOps() as mode:
        yield mode.ops


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_cuda_routes_make_the_same_calls_for_3_or_30_tensors(dtype: torch.dtype) -> None:
    """No Python loop over the tensors: the aten calls per operation do not grow with their number."""
    calls = []
    for count in (3, 30):
        grads = [torch.randn(5, 7).to(dtype) for _ in range(count)]
        with cuda_rules_on_cpu(), _aten_ops() as ops:
            TorchKernels().unscale_(grads, torch.tensor(0.5), torch.zeros(()))
            TorchKernels().mul_(grads, torch.tensor(0.5))
        calls.append(ops)
    assert calls[0] == calls[1]
    assert not any("_local_scalar_dense" in op for op in calls[0])  # no value read back


@pytest.mark.cuda
@pytest.mark.parametrize("factor", [0.1, 2.0**-16])
def test_cuda_gives_the_cpu_bits_for_bf16_and_fp16(factor: float) -> None:
    """On a real GPU: bf16 (no torch unscale kernel) and fp16 (a factor rounded by _foreach_mul_)."""
    grads = _with_odd_shapes(make_grads(MIXES["mixed"], CPU, "middle", math.inf))
    kernels = TorchKernels()
    cpu_unscaled, cpu_multiplied, cpu_inf = clone(grads), clone(grads), torch.zeros(())
    kernels.unscale_(cpu_unscaled, torch.tensor(factor), cpu_inf)
    kernels.mul_(cpu_multiplied, torch.tensor(factor))
    unscaled, multiplied = [g.cuda() for g in grads], [g.cuda() for g in grads]
    found_inf = torch.zeros((), device="cuda")
    kernels.unscale_(unscaled, torch.tensor(factor, device="cuda"), found_inf)
    kernels.mul_(multiplied, torch.tensor(factor, device="cuda"))
    assert_bit_identical(unscaled, cpu_unscaled)
    assert_bit_identical(multiplied, cpu_multiplied)
    assert found_inf.item() == cpu_inf.item() == 1.0


# --- norms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, None], ids=["1-thread", "default-threads"])
def test_exact_norm_is_torchs_clip_norm_and_fast_norm_is_within_fp32s_error(threads: int | None) -> None:
    """The exact norm is ``clip_grad_norm_``'s, bit for bit; the fast one is as accurate as fp32 sums allow.

    The fast CPU norm sums squares with BLAS ``dot``, whose order of summation (SIMD lanes,
    threads) depends on the BLAS build, the CPU and the thread count. So its bound comes from fp64,
    not from one BLAS: summed in any order, the rounding error of ``m`` fp32 terms stays below
    ``lam * sqrt(m) * u`` (u = 2**-24) except with probability about ``exp(-lam**2 / 2)`` (Higham
    and Mary's probabilistic bound), and ``lam = 10`` makes a false failure practically impossible.
    A wrong accumulation (fp16, dropped terms, a lost tensor) misses it by orders of magnitude.
    """
    from amp_plugin._sharding import ShardAwareKernels

    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        torch.manual_seed(3)
        grads = [torch.randn(3_000_000), torch.randn(7), torch.randn(50_000)]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
        kernels = get_kernels("torch")
        assert torch.equal(kernels.norm(grads, exact=True), torch_norm)
        assert torch.equal(ShardAwareKernels(kernels).norm(grads, exact=True), torch_norm)  # forwarded
        fast = kernels.norm(grads)
    finally:
        torch.set_num_threads(saved)
    truth = torch.cat(grads).double().norm()
    assert fast.dtype == torch.float32
    longest = max(g.numel() for g in grads)
    # sqrt halves the sum of squares' relative error; one more u for the products and the sqrt.
    bound = 10 * math.sqrt(longest) * 2.0**-24 / 2 + 2 * 2.0**-24
    assert float(abs(fast.double() - truth) / truth) <= bound


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fast_cpu_norm_flags_nonfinite_and_handles_strided(bad: float) -> None:
    grads = [torch.randn(8, 8).t(), torch.randn(100)]  # one non-contiguous tensor
    expected = torch.cat([g.reshape(-1) for g in grads]).double().norm()
    assert torch.isclose(get_kernels("torch").norm(grads).double(), expected, rtol=1e-6)
    grads[1][50] = bad
    assert not torch.isfinite(get_kernels("torch").norm(grads))
