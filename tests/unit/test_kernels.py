"""Contract tests of every kernel backend, with the torch backend as the oracle.

Backends: ``torch``; ``apex-fake`` (the real ``ApexKernels`` dispatch code on CPU, launching a
pure-torch double of ``amp_C``); and real Apex on CUDA with the scale on the host or the device
(skipped without a GPU and Apex).
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import cycle

import pytest
import torch
from torch import Tensor

from amp_plugin.kernels import Kernels, get_kernels
from amp_plugin.kernels import apex as apex_module
from amp_plugin.kernels.apex import ApexKernels
from amp_plugin.kernels.torch import TorchKernels
from tests.fakes import FakeApex, fake_amp_c, fake_apex, no_apex

FP16, BF16, FP32, FP64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
CPU = torch.device("cpu")
ORACLE = TorchKernels()
SMALL_CHUNK = 64  # the double then sums several chunks per tensor, as amp_C's blocks do

MIXES = {"fp32": (FP32,), "fp16": (FP16,), "bf16": (BF16,), "mixed": (FP16, FP32, BF16)}
SHAPES = ((5,), (10, 13), (1,), (0,), (257,))  # zero-numel near the end; the last one spans several chunks
POSITIONS = {"first": (0, 0), "middle": (1, 65), "last": (-1, -1)}  # (tensor, flat element)
NONFINITE = [
    pytest.param(None, None, id="finite"),
    *(pytest.param(where, math.inf, id=f"inf-{where}") for where in POSITIONS),
    *(pytest.param(where, math.nan, id=f"nan-{where}") for where in POSITIONS),
    pytest.param("middle", -math.inf, id="-inf-middle"),
]
REAL_APEX = [pytest.mark.cuda, pytest.mark.apex]


@dataclass(frozen=True)
class Backend:
    kernels: Kernels
    device: torch.device  # where the gradients live
    scalar_device: torch.device  # where inv_scale / factor live

    def scalar(self, value: float) -> Tensor:
        return torch.tensor(value, dtype=FP32, device=self.scalar_device)

    def zeros(self) -> Tensor:
        return torch.zeros((), dtype=FP32, device=self.device)


@pytest.fixture
def fake() -> Iterator[FakeApex]:
    with fake_apex(chunk_size=SMALL_CHUNK) as installed:
        yield installed


@pytest.fixture(
    params=[
        pytest.param("torch"),
        pytest.param("apex-fake"),
        pytest.param("apex-host-scale", marks=REAL_APEX),
        pytest.param("apex-device-scale", marks=REAL_APEX),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "torch":
        return Backend(TorchKernels(), CPU, CPU)
    if request.param == "apex-fake":
        request.getfixturevalue("fake")
        return Backend(ApexKernels(), CPU, CPU)
    cuda = torch.device("cuda", torch.cuda.current_device())
    return Backend(get_kernels("apex", cuda), cuda, CPU if request.param == "apex-host-scale" else cuda)


def make_grads(
    mix: Sequence[torch.dtype],
    device: torch.device = CPU,
    where: str | None = None,
    value: float | None = None,
    magnitude: float = 1000.0,
) -> list[Tensor]:
    """Scaled-gradient-like tensors cycling through ``mix``; ``value`` planted at ``where``."""
    gen = torch.Generator().manual_seed(1234)
    grads = [
        (torch.randn(shape, generator=gen) * magnitude).to(dtype) for shape, dtype in zip(SHAPES, cycle(mix))
    ]
    if where is not None and value is not None:
        tensor, element = POSITIONS[where]
        grads[tensor].view(-1)[element] = value
    return [grad.to(device) for grad in grads]


def clone(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [tensor.clone() for tensor in tensors]


def assert_bit_identical(actual: Sequence[Tensor], expected: Sequence[Tensor]) -> None:
    as_int = {FP16: torch.int16, BF16: torch.int16, FP32: torch.int32, FP64: torch.int64}
    for got, want in zip(actual, expected, strict=True):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        got, want = got.cpu(), want.cpu()
        nan = got.isnan()
        assert torch.equal(nan, want.isnan())
        assert torch.equal(got[~nan].view(as_int[got.dtype]), want[~nan].view(as_int[want.dtype]))


def fp64_norm(tensors: Sequence[Tensor], norm_type: float) -> Tensor:
    flat = [tensor.detach().double().cpu().reshape(-1) for tensor in tensors]
    norm: Tensor = torch.linalg.vector_norm(
        torch.cat(flat) if flat else torch.zeros(0, dtype=FP64), norm_type
    )
    return norm


# --- unscale_ ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inv_scale", [2.0**-16, 1 / 3], ids=["pow2", "third"])
@pytest.mark.parametrize(("where", "value"), NONFINITE)
@pytest.mark.parametrize("mix", MIXES)
def test_unscale_is_bit_identical_to_torch(
    backend: Backend, mix: str, where: str | None, value: float | None, inv_scale: float
) -> None:
    grads = make_grads(MIXES[mix], backend.device, where, value)
    expected, expected_inf = clone(grads), backend.zeros()
    found_inf = backend.zeros()

    backend.kernels.unscale_(grads, backend.scalar(inv_scale), found_inf)
    ORACLE.unscale_(expected, backend.scalar(inv_scale), expected_inf)

    assert_bit_identical(grads, expected)
    assert found_inf.item() == expected_inf.item() == (0.0 if where is None else 1.0)


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


def test_huge_finite_values_are_not_an_overflow(backend: Backend) -> None:
    """Only non-finite inputs count: not amp_C's norm flag on fp32 squares, not outputs that overflow."""
    grads = [
        torch.tensor(values, dtype=dtype, device=backend.device)
        for values, dtype in (([1e20, 1.0], FP32), ([1e20], BF16), ([6e4], FP16))
    ]
    expected = clone(grads)
    found_inf = backend.zeros()
    backend.kernels.norm(grads)  # squares of 1e20 overflow fp32: amp_C's norm flag must not leak
    backend.kernels.unscale_(grads, backend.scalar(1.0), found_inf)
    backend.kernels.unscale_(grads, backend.scalar(2.0**16), found_inf)  # 6e4 * 2**16 overflows fp16
    for factor in (1.0, 2.0**16):
        ORACLE.unscale_(expected, backend.scalar(factor), backend.zeros())
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
    torch.testing.assert_close(norm.double().cpu(), fp64_norm(grads, norm_type), rtol=1e-6, atol=0)


def test_fp16_norm_above_fp16_max_is_finite(backend: Backend) -> None:
    grads = [torch.full((4,), 60000.0, dtype=FP16, device=backend.device)]
    assert backend.kernels.norm(grads).item() == pytest.approx(120000.0, rel=1e-6)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize(("where", "value"), NONFINITE[1:])
def test_nonfinite_input_gives_nonfinite_norm(
    backend: Backend, where: str, value: float, norm_type: float
) -> None:
    grads = make_grads(MIXES["mixed"], backend.device, where, value)
    assert not torch.isfinite(backend.kernels.norm(grads, norm_type))


# --- mul_ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.1, 2.0**-7])
@pytest.mark.parametrize("mix", MIXES)
def test_mul_is_bit_identical_to_torch(backend: Backend, mix: str, factor: float) -> None:
    grads = make_grads(MIXES[mix], backend.device, "middle", math.nan)
    expected = clone(grads)
    backend.kernels.mul_(grads, backend.scalar(factor))
    ORACLE.mul_(expected, backend.scalar(factor))
    assert_bit_identical(grads, expected)


# --- host syncs ----------------------------------------------------------------------------------


@contextlib.contextmanager
def recorded_host_reads() -> Iterator[list[Tensor]]:
    """Every tensor whose value Python reads back (``.item()``, ``float(t)``, ``if t``, ...)."""
    reads: list[Tensor] = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            original = getattr(torch.Tensor, name)

            def spy(self: Tensor, *args: object, _original: object = original) -> object:
                reads.append(self)
                return _original(self, *args)  # type: ignore[operator]

            patch.setattr(torch.Tensor, name, spy)
        yield reads


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


# --- how ApexKernels dispatches (through the double) ---------------------------------------------


def test_apex_launches_once_per_device_and_dtype(fake: FakeApex) -> None:
    kernels = ApexKernels()
    grads = make_grads(MIXES["mixed"])  # fp16, fp32, bf16 groups
    kernels.unscale_(grads, torch.tensor(0.5), torch.zeros(()))
    kernels.norm(grads)
    assert fake.calls == ["multi_tensor_scale"] * 3 + ["multi_tensor_l2norm"] * 3


def test_apex_gives_torch_what_amp_c_cannot_run(fake: FakeApex) -> None:
    grads = [
        torch.randn(8, 16).t(),  # not contiguous
        torch.randn(4, 6)[:, ::2],  # not dense either
        torch.randn(7, dtype=FP64),  # no fp64 kernels
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),  # amp_C takes channels-last
    ]
    expected, found_inf, expected_inf = clone(grads), torch.zeros(()), torch.zeros(())
    grads[2][3] = expected[2][3] = math.inf
    ApexKernels().unscale_(grads, torch.tensor(1 / 3), found_inf)
    ORACLE.unscale_(expected, torch.tensor(1 / 3), expected_inf)
    assert_bit_identical(grads, expected)
    assert found_inf.item() == expected_inf.item() == 1.0
    assert fake.calls == ["multi_tensor_scale"]


def test_apex_sends_cpu_tensors_to_torch_outside_tests() -> None:
    with fake_apex(cpu=False) as installed:
        grads = make_grads(MIXES["mixed"])
        expected = clone(grads)
        ApexKernels().unscale_(grads, torch.tensor(0.25), torch.zeros(()))
        norm = ApexKernels().norm(grads)
        assert installed.calls == []
    ORACLE.unscale_(expected, torch.tensor(0.25), torch.zeros(()))
    assert norm.item() == ORACLE.norm(expected).item()
    assert_bit_identical(grads, expected)


def test_apex_with_a_device_scale_only_uses_amp_c_for_the_norm(
    fake: FakeApex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale on the GPU is never read back: torch's ops take it as a tensor, amp_C would need a float."""
    monkeypatch.setattr(apex_module, "_host_value", lambda scalar: None)  # what a CUDA scale looks like
    grads = make_grads(MIXES["mixed"])
    expected, found_inf, expected_inf = clone(grads), torch.zeros(()), torch.zeros(())
    ApexKernels().unscale_(grads, torch.tensor(1 / 3), found_inf)
    norm = ApexKernels().norm(grads)
    ORACLE.unscale_(expected, torch.tensor(1 / 3), expected_inf)
    expected_norm = ORACLE.norm(expected)
    ApexKernels().mul_(grads, torch.tensor(0.1))
    ORACLE.mul_(expected, torch.tensor(0.1))
    assert fake.calls == ["multi_tensor_l2norm"] * 3
    assert_bit_identical(grads, expected)
    assert found_inf.item() == expected_inf.item()
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)


def test_apex_kernels_satisfy_the_protocol(fake: FakeApex) -> None:
    assert isinstance(ApexKernels(), Kernels)
    assert ApexKernels().name == "apex"


# --- the double itself ----------------------------------------------------------------------------


def new_flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32)


class TestFakeAmpC:
    @pytest.mark.parametrize(
        ("lists", "match"),
        [
            ([[], []], "is empty"),
            ([[torch.ones(2), torch.ones(2, dtype=FP16)]] * 2, "mixes dtypes"),
            ([[torch.ones(2)], [torch.ones(3)]], "elements"),
            ([[torch.ones(0)], [torch.ones(0)]], "zero elements"),
            ([[torch.ones(3, 2).t()]] * 2, "not contiguous"),
            ([[torch.ones(2, dtype=FP64)]] * 2, "supports"),
            ([[torch.ones(2)]], "expected 2 tensor lists"),
        ],
    )
    def test_rejects_what_amp_c_cannot_launch(self, lists: list[list[Tensor]], match: str) -> None:
        with pytest.raises(RuntimeError, match=match):
            fake_amp_c.multi_tensor_scale(64, new_flag(), lists, 1.0)

    def test_rejects_a_tensor_scale_and_a_bad_flag(self) -> None:
        lists = [[torch.ones(2)]] * 2
        with pytest.raises(TypeError, match="device sync"):
            fake_amp_c.multi_tensor_scale(64, new_flag(), lists, torch.tensor(1.0))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="int32"):
            fake_amp_c.multi_tensor_scale(64, torch.zeros(1), lists, 1.0)
        with pytest.raises(RuntimeError, match="supports"):
            fake_amp_c.multi_tensor_l2norm_scale(
                64, new_flag(), [[torch.ones(2, dtype=BF16)]] * 2, 1.0, False
            )

    def test_flag_is_only_ever_set(self) -> None:
        flag = torch.ones(1, dtype=torch.int32)
        fake_amp_c.multi_tensor_scale(64, flag, [[torch.ones(3)]] * 2, 2.0)
        assert flag.item() == 1
        flag.zero_()
        fake_amp_c.multi_tensor_scale(64, flag, [[torch.tensor([1.0, math.nan])]] * 2, 2.0)
        assert flag.item() == 1

    def test_l2norm_shapes_and_flag(self) -> None:
        flag = new_flag()
        tensors = [torch.full((100,), 3.0), torch.full((4,), 4.0, dtype=FP32)]
        total, per_tensor = fake_amp_c.multi_tensor_l2norm(16, flag, [tensors], True)
        assert total.shape == (1,) and per_tensor.tolist() == [30.0, 8.0]
        assert fake_amp_c.multi_tensor_l2norm(16, flag, [tensors], False)[1].shape == (0,)
        assert flag.item() == 0
        fake_amp_c.multi_tensor_l2norm(16, flag, [[torch.tensor([1e20])]])  # finite, but the square is not
        assert flag.item() == 1

    def test_l2norm_scale_measures_its_inputs(self) -> None:
        src, dst = torch.full((4,), 2.0, dtype=FP16), torch.empty(4, dtype=FP16)
        total, _ = fake_amp_c.multi_tensor_l2norm_scale(64, new_flag(), [[src], [dst]], 0.5, False)
        assert total.item() == 4.0 and dst.tolist() == [1.0] * 4

    def test_update_scale_hysteresis(self) -> None:
        scale, growth = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
        hysteresis = torch.tensor(2, dtype=torch.int32)

        def step(inf: bool) -> tuple[float, int, int]:
            fake_amp_c.update_scale_hysteresis(
                scale, growth, hysteresis, torch.tensor(float(inf)), 2.0, 0.5, 2, 2
            )
            return scale.item(), int(growth.item()), int(hysteresis.item())

        assert step(True) == (8.0, 0, 1)  # first overflow: no backoff yet
        assert step(True) == (4.0, 0, 0)  # budget spent: back off
        assert step(False) == (4.0, 1, 2)  # a clean step refills the budget
        assert step(False) == (8.0, 0, 2)  # growth_interval clean steps: grow


# --- choosing a backend ---------------------------------------------------------------------------


def test_auto_on_cpu_is_torch() -> None:
    assert get_kernels("auto", "cpu").name == "torch"
    assert get_kernels("auto").name == "torch"


def test_auto_on_cuda_is_apex_when_amp_c_imports() -> None:
    with fake_apex():
        assert get_kernels("auto", "cuda").name == "apex"
    with no_apex():
        assert get_kernels("auto", "cuda").name == "torch"


def test_explicit_apex_without_amp_c_raises_with_a_build_hint() -> None:
    with no_apex():
        with pytest.raises(RuntimeError, match=r"amp_C.*HINT:.*--cuda_ext"):
            get_kernels("apex", "cuda")
        with pytest.raises(ImportError, match=r"amp_C.*HINT:.*--cuda_ext"):
            ApexKernels()


def test_explicit_apex_off_cuda_raises() -> None:
    with fake_apex(), pytest.raises(RuntimeError, match=r"CUDA tensors only.*'cpu'.*HINT:"):
        get_kernels("apex", "cpu")


def test_unknown_backend_raises() -> None:
    with pytest.raises(ValueError, match=r"kernels='triton' is not a kernel backend.*HINT:"):
        get_kernels("triton")  # type: ignore[arg-type]


def test_import_loads_neither_apex_nor_lightning_nor_cuda() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import amp_plugin
        from amp_plugin.kernels import get_kernels

        get_kernels("auto", "cpu")
        banned = ("amp_C", "apex", "lightning", "pytorch_lightning", "lightning_fabric")
        print(sorted(m for m in sys.modules if m.split(".")[0] in banned), torch.cuda.is_initialized())
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.split()) == (0, ["[]", "False"]), result.stderr


def test_torch_norm_exact_is_torchs_clip_norm_and_fast_norm_is_more_accurate() -> None:
    from amp_plugin.distributed import GlobalNormKernels

    torch.manual_seed(3)
    grads = [torch.randn(3_000_000), torch.randn(7), torch.randn(50_000)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
    kernels = get_kernels("torch")
    assert torch.equal(kernels.norm(grads, exact=True), torch_norm)
    assert torch.equal(GlobalNormKernels(kernels).norm(grads, exact=True), torch_norm)  # forwarded
    truth = torch.cat(grads).double().norm()
    fast = kernels.norm(grads)
    assert fast.dtype == torch.float32
    assert abs(fast.double() - truth) / truth < 1e-5
    assert abs(fast.double() - truth) <= abs(torch_norm.double() - truth)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fast_cpu_norm_flags_nonfinite_and_handles_strided(bad: float) -> None:
    grads = [torch.randn(8, 8).t(), torch.randn(100)]  # one non-contiguous tensor
    expected = torch.cat([g.reshape(-1) for g in grads]).double().norm()
    assert torch.isclose(get_kernels("torch").norm(grads).double(), expected, rtol=1e-6)
    grads[1][50] = bad
    assert not torch.isfinite(get_kernels("torch").norm(grads))
