"""Contract tests of every kernel backend (``amp_plugin.kernels._base``) against the fp64 reference.

The oracle is ``tests/unit/kernels/_reference.py`` (fp64 math, explicit rounding), never a backend;
where the contract promises bit-identity with a torch op, that op is the second oracle.

Backends: ``torch`` on each device (``torch-cpu``; ``torch-cuda``, skipped without a GPU; and
``torch-cuda-rules``, the CPU made to follow CUDA's rules by ``tests/fakes/cuda_rules.py``: no bf16
unscale op, a device factor rounded to a half tensor's dtype by ``_foreach_mul_``, so the CUDA routes
run here); ``apex-fake`` (the real ``ApexKernels`` dispatch code on CPU, launching a pure-torch double
of ``amp_C``); and real Apex on CUDA with the scale on the host or the device (skipped without a GPU
and Apex). The oracles use the device's arithmetic: the reference flushes fp32 subnormals for real
``amp_C`` (``--use_fast_math``), and torch's unscale op is called only where it has the dtype.
"""

from __future__ import annotations

import math

import numpy
import pytest
import torch
from torch import Tensor

from amp_plugin.kernels import get_kernels
from amp_plugin.kernels._apex import ApexKernels
from amp_plugin.kernels._foreach import TorchKernels
from tests.unit.kernels._reference import reference_mul, reference_norm, reference_unscale, round_to, scaled
from tests.unit.kernels._tensors import (
    BF16,
    CPU,
    FP16,
    FP32,
    FP64,
    MIXES,
    NONFINITE,
    REAL_APEX,
    Backend,
    assert_bit_identical,
    clone,
    make_grads,
    recorded_host_reads,
)


@pytest.fixture(
    params=[
        pytest.param("torch-cpu"),
        pytest.param("torch-cuda-rules"),
        pytest.param("torch-cuda", marks=pytest.mark.cuda),
        pytest.param("apex-fake"),
        pytest.param("apex-host-scale", marks=REAL_APEX),
        pytest.param("apex-device-scale", marks=REAL_APEX),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "torch-cpu":
        return Backend(TorchKernels(), CPU, CPU)
    if request.param == "torch-cuda-rules":
        request.getfixturevalue("cuda_rules")
        return Backend(TorchKernels(), CPU, CPU, unscale_op_has_bf16=False)
    if request.param == "apex-fake":
        request.getfixturevalue("fake")
        return Backend(ApexKernels(), CPU, CPU)
    cuda = torch.device("cuda", torch.cuda.current_device())
    if request.param == "torch-cuda":
        return Backend(TorchKernels(), cuda, cuda, unscale_op_has_bf16=False)
    host_scale = request.param == "apex-host-scale"  # only then does amp_C multiply (a host float)
    return Backend(
        get_kernels("apex", cuda),
        cuda,
        CPU if host_scale else cuda,
        flush=host_scale,
        unscale_op_has_bf16=False,
    )


# --- unscale_ ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inv_scale", [2.0**-16, 1 / 3], ids=["pow2", "third"])
@pytest.mark.parametrize(("where", "value"), NONFINITE)
@pytest.mark.parametrize("mix", MIXES)
def test_unscale_matches_fp64_and_is_bit_identical_to_torch(
    backend: Backend, mix: str, where: str | None, value: float | None, inv_scale: float
) -> None:
    grads = make_grads(MIXES[mix], backend.device, where, value)
    expected, expected_inf = reference_unscale(grads, backend.scalar(inv_scale).item(), backend.flush)
    # The op the contract names, called directly where the device has it for the dtype (CUDA: no bf16).
    covered = [tensor for tensor in grads if backend.has_unscale_op(tensor)]
    torchs, torchs_inf = clone(covered), backend.zeros()
    for tensor in torchs:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [tensor], torchs_inf, backend.scalar(inv_scale).to(tensor.device)
        )
    found_inf = backend.zeros()

    backend.kernels.unscale_(grads, backend.scalar(inv_scale), found_inf)

    assert_bit_identical(grads, expected)
    assert_bit_identical([tensor for tensor in grads if backend.has_unscale_op(tensor)], torchs)
    assert found_inf.item() == expected_inf == (0.0 if where is None else 1.0)
    assert torchs_inf.item() == reference_unscale(covered, 1.0)[1]


@pytest.mark.parametrize("factor", [0.1, 1 / 3, 2.0**-16])
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_unscale_and_mul_of_every_fp16_and_bf16_value(
    backend: Backend, dtype: torch.dtype, factor: float
) -> None:
    """Every finite value of the dtype at once.

    0.1 is a factor where rounding through fp32 matters, and where a factor rounded to the tensor's
    dtype first (``_foreach_mul_`` by a CUDA scalar) gives other bits; 2**-16 sends bf16 values below
    fp32's smallest normal, where real ``amp_C`` flushes (the reference models it for that backend).
    """
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[every.isfinite()]
    expected = reference_mul([every], backend.scalar(factor).item(), backend.flush)
    unscaled, multiplied = every.to(backend.device, copy=True), every.to(backend.device, copy=True)
    found_inf = backend.zeros()
    backend.kernels.unscale_([unscaled], backend.scalar(factor), found_inf)
    backend.kernels.mul_([multiplied], backend.scalar(factor))
    assert_bit_identical([unscaled], expected)
    assert_bit_identical([multiplied], expected)
    assert found_inf.item() == 0.0


def test_unscale_never_resets_found_inf(backend: Backend) -> None:
    found_inf = torch.ones((), device=backend.device)
    backend.kernels.unscale_(make_grads(MIXES["mixed"], backend.device), backend.scalar(0.5), found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize(
    "tensors", [[], [torch.empty(0)], [torch.empty(0, 3, dtype=FP16)]], ids=["empty", "0", "0x3"]
)
def test_nothing_to_do_is_fine(backend: Backend, tensors: list[Tensor]) -> None:
    tensors = [tensor.to(backend.device) for tensor in tensors]
    found_inf = backend.zeros()
    backend.kernels.unscale_(tensors, backend.scalar(0.5), found_inf)
    backend.kernels.mul_(tensors, backend.scalar(0.5))
    assert found_inf.item() == 0.0
    norm = backend.kernels.norm(tensors)
    assert (norm.item(), norm.dtype, norm.shape) == (0.0, FP32, ())


def test_gradients_with_autograd_history_are_written_without_recording_any(backend: Backend) -> None:
    """A ``create_graph=True`` backward leaves gradients that require grad: written in place, no history."""
    weights = [torch.ones(3, device=backend.device, requires_grad=True) for _ in range(2)]
    loss = sum((w**3).sum() for w in weights) * 4.0  # each gradient 12 * w**2 = 12, with a graph of its own
    grads = list(torch.autograd.grad(loss, weights, create_graph=True))
    assert all(g.requires_grad for g in grads)
    before = [g.grad_fn for g in grads]
    found_inf = backend.zeros()
    backend.kernels.unscale_(grads, backend.scalar(0.5), found_inf)
    backend.kernels.mul_(grads, backend.scalar(0.5))
    assert [g.tolist() for g in grads] == [[3.0] * 3] * 2 and found_inf.item() == 0.0
    assert [g.grad_fn for g in grads] == before  # nothing recorded: the graph is the backward's own


def test_huge_finite_values_are_not_an_overflow(backend: Backend) -> None:
    """Only non-finite inputs count: not amp_C's norm flag on fp32 squares, not outputs that overflow."""
    grads = [
        torch.tensor(values, dtype=dtype, device=backend.device)
        for values, dtype in (([1e20, 1.0], FP32), ([1e20], BF16), ([6e4], FP16))
    ]
    expected = reference_mul(reference_mul(grads, 1.0, backend.flush), 2.0**16, backend.flush)
    found_inf = backend.zeros()
    backend.kernels.norm(grads)  # squares of 1e20 overflow fp32: amp_C's norm flag must not leak
    backend.kernels.unscale_(grads, backend.scalar(1.0), found_inf)
    backend.kernels.unscale_(grads, backend.scalar(2.0**16), found_inf)  # 6e4 * 2**16 overflows fp16
    assert_bit_identical(grads, expected)
    assert math.isinf(grads[2].item())
    assert found_inf.item() == 0.0


# --- norm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("mix", MIXES)
def test_norm_matches_fp64_norm_of_the_concatenation(backend: Backend, mix: str, norm_type: float) -> None:
    grads = make_grads(MIXES[mix], backend.device)
    norm = backend.kernels.norm(grads, norm_type)
    assert (norm.dtype, norm.shape, norm.device) == (FP32, torch.Size([]), backend.device)
    # exact=False allows any fp32 reduction, hence the tolerance (exact=True: see test_foreach)
    torch.testing.assert_close(norm.double().cpu(), reference_norm(grads, norm_type), rtol=1e-6, atol=0)


def test_fp16_norm_above_fp16_max_is_finite(backend: Backend) -> None:
    grads = [torch.full((4,), 60000.0, dtype=FP16, device=backend.device)]
    assert backend.kernels.norm(grads).item() == pytest.approx(120000.0, rel=1e-6)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize(("where", "value"), NONFINITE[1:])
def test_nonfinite_input_gives_nonfinite_norm(
    backend: Backend, where: str, value: float, norm_type: float
) -> None:
    grads = make_grads(MIXES["mixed"], backend.device, where, value)
    norm, expected = backend.kernels.norm(grads, norm_type), reference_norm(grads, norm_type)
    assert not torch.isfinite(norm)  # the contract: a norm doubles as an inf check
    if math.isinf(value):  # the norm of an inf is inf; with a NaN the contract only promises non-finite
        assert norm.item() == expected.item() == math.inf


# --- mul_ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.1, 2.0**-7])
@pytest.mark.parametrize("mix", MIXES)
def test_mul_matches_fp64(backend: Backend, mix: str, factor: float) -> None:
    grads = make_grads(MIXES[mix], backend.device, "middle", math.nan)
    expected = reference_mul(grads, backend.scalar(factor).item(), backend.flush)
    backend.kernels.mul_(grads, backend.scalar(factor))
    assert_bit_identical(grads, expected)


# --- host syncs ----------------------------------------------------------------------------------


def test_no_value_is_read_back_except_a_host_resident_scale(backend: Backend) -> None:
    grads = make_grads(MIXES["mixed"], backend.device, "middle", math.inf)
    scale, found_inf = backend.scalar(0.5), backend.zeros()
    with recorded_host_reads() as reads:
        backend.kernels.unscale_(grads, scale, found_inf)
        backend.kernels.mul_(grads, scale)
        for norm_type in (2.0, 1.0):
            backend.kernels.norm(grads, norm_type)
    assert not [tensor for tensor in reads if tensor is not scale]
    if isinstance(backend.kernels, TorchKernels) or backend.scalar_device.type != "cpu":
        assert not reads


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["torch", pytest.param("apex", marks=pytest.mark.apex)])
def test_no_device_sync_on_cuda(name: str) -> None:
    kernels = get_kernels(name, "cuda")  # type: ignore[arg-type]
    grads = make_grads(MIXES["mixed"], torch.device("cuda"), "last", math.nan)
    scale, found_inf = torch.tensor(0.5, device="cuda"), torch.zeros((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.unscale_(grads, scale, found_inf)
        kernels.mul_(grads, scale)
        kernels.norm(grads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert found_inf.item() == 1.0


# --- the reference itself ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_reference_rounding_is_ieee_round_to_nearest_even(dtype: torch.dtype) -> None:
    """round_to agrees with casts known to round once: numpy's fp64 -> fp16 and torch's fp64 -> fp32."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(200_000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 20, (200_000,), generator=gen).double()
    )
    values = torch.cat(
        [values, torch.tensor([0.0, -0.0, 65519.99, 65520.0, 2.0**-25, 3 * 2.0**-26, math.nan])]
    )
    with numpy.errstate(over="ignore"):  # 65520 rounds to inf on purpose
        ieee = torch.from_numpy(values.numpy().astype(numpy.float16)) if dtype == FP16 else values.float()
    assert_bit_identical([round_to(values, dtype)], [ieee])


def test_reference_flush_mode_models_fast_math() -> None:
    """fp32 subnormal operands and products become a signed zero; a normal product is untouched."""
    grads = [torch.tensor([2.0**-111, -(2.0**-111), 2.0**-110, 2.0**-130], dtype=BF16)]
    assert scaled(grads[0], 2.0**-16).tolist() == [2.0**-127, -(2.0**-127), 2.0**-126, 0.0]
    flushed = scaled(grads[0], 2.0**-16, flush=True)
    assert flushed.tolist() == [0.0, 0.0, 2.0**-126, 0.0]
    assert torch.signbit(flushed).tolist() == [False, True, False, False]
    assert scaled(torch.tensor([2.0**-130], dtype=FP32), 2.0**10, flush=True).item() == 0.0  # operand flushed


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("exact", [False, True])
def test_fp64_gradients_have_an_fp64_norm(backend: Backend, norm_type: float, exact: bool) -> None:
    grads = make_grads((FP64, FP32), backend.device)
    norm = backend.kernels.norm(grads, norm_type, exact=exact)
    assert norm.dtype == FP64  # torch computes no fp32 norm of fp64 tensors
    torch.testing.assert_close(norm.cpu(), reference_norm(grads, norm_type), rtol=1e-6, atol=0)
