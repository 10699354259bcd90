"""Tests for ``amp_plugin.kernels.foreach``, the torch backend: its exact and fast norms."""

from __future__ import annotations

import pytest
import torch

from amp_plugin.kernels import get_kernels


@pytest.mark.parametrize("threads", [1, None], ids=["1-thread", "default-threads"])
def test_torch_norm_exact_is_torchs_clip_norm_and_fast_norm_is_more_accurate(threads: int | None) -> None:
    """The fast norm beats torch's fp32 reduction by 2x or more at any thread count.

    sdot's error depends on the thread count (each thread sums its own part), torch's does not;
    one thread is the worst case (1.95e-5 against torch's 6.3e-5 here), so it is checked in every
    run, whatever thread count the suite itself runs with.
    """
    from amp_plugin.sharding import ShardAwareKernels

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
    fast_error, torch_error = (float(abs(n.double() - truth) / truth) for n in (fast, torch_norm))
    assert fast_error < 5e-5
    assert 2 * fast_error <= torch_error


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fast_cpu_norm_flags_nonfinite_and_handles_strided(bad: float) -> None:
    grads = [torch.randn(8, 8).t(), torch.randn(100)]  # one non-contiguous tensor
    expected = torch.cat([g.reshape(-1) for g in grads]).double().norm()
    assert torch.isclose(get_kernels("torch").norm(grads).double(), expected, rtol=1e-6)
    grads[1][50] = bad
    assert not torch.isfinite(get_kernels("torch").norm(grads))
