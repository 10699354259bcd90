"""Tests for ``amp_plugin.kernels._apex``: ``ApexKernels``' dispatch (through the double), and the double."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from amp_plugin.kernels import Kernels
from amp_plugin.kernels import _apex as apex_module
from amp_plugin.kernels._apex import ApexKernels
from tests.fakes import FakeApex, fake_amp_c, fake_apex
from tests.unit.kernels._reference import reference_mul, reference_norm, reference_unscale
from tests.unit.kernels._tensors import (
    BF16,
    FP16,
    FP32,
    FP64,
    MIXES,
    assert_bit_identical,
    make_grads,
)

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
    grads[2][3] = math.inf
    expected, expected_inf = reference_unscale(grads, torch.tensor(1 / 3).item())
    found_inf = torch.zeros(())
    ApexKernels().unscale_(grads, torch.tensor(1 / 3), found_inf)
    assert_bit_identical(grads, expected)
    assert found_inf.item() == expected_inf == 1.0
    assert fake.calls == ["multi_tensor_scale"]


def test_apex_sends_cpu_tensors_to_torch_outside_tests() -> None:
    with fake_apex(cpu=False) as installed:
        grads = make_grads(MIXES["mixed"])
        expected, _ = reference_unscale(grads, 0.25)
        ApexKernels().unscale_(grads, torch.tensor(0.25), torch.zeros(()))
        norm = ApexKernels().norm(grads)
        assert installed.calls == []
    torch.testing.assert_close(norm.double(), reference_norm(expected, 2.0), rtol=1e-6, atol=0)
    assert_bit_identical(grads, expected)


def test_apex_with_a_device_scale_only_uses_amp_c_for_the_norm(
    fake: FakeApex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale on the GPU is never read back: torch's ops take it as a tensor, amp_C would need a float."""
    monkeypatch.setattr(apex_module, "_host_value", lambda scalar: None)  # what a CUDA scale looks like
    grads = make_grads(MIXES["mixed"])
    expected, expected_inf = reference_unscale(grads, torch.tensor(1 / 3).item())
    expected_norm = reference_norm(expected, 2.0)
    expected = reference_mul(expected, torch.tensor(0.1).item())
    found_inf = torch.zeros(())
    ApexKernels().unscale_(grads, torch.tensor(1 / 3), found_inf)
    norm = ApexKernels().norm(grads)
    ApexKernels().mul_(grads, torch.tensor(0.1))
    assert fake.calls == ["multi_tensor_l2norm"] * 3
    assert_bit_identical(grads, expected)
    assert found_inf.item() == expected_inf
    torch.testing.assert_close(norm.double(), expected_norm, rtol=1e-6, atol=0)


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
