"""Clipping acts on unscaled gradients on every path; torch's unscale_ + clip_grad_norm_ is the oracle."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from amp_plugin._clipping import clamp_, clip_grad_norm_, gradients, nonfinite, rewrite_pays
from amp_plugin.kernels import get_kernels

SCALE = 2.0**12


def _setup(fused: bool = False, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # a parameter without a gradient
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    return model, opt


def _backward(scaler: Any, model: nn.Module, poison: bool = False) -> None:
    torch.manual_seed(1)
    scaler.scale(model(torch.randn(5, 8)).pow(2).sum() * 50).backward()
    if poison:
        model[2].weight.grad[1, 1] = float("inf")


def _reference(max_norm: float, norm_type: float, fused: bool = False) -> tuple[nn.Module, torch.Tensor]:
    model, opt = _setup(fused)
    ref = torch.amp.GradScaler("cpu", init_scale=SCALE)
    _backward(ref, model)
    ref.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    ref.step(opt)
    ref.update()
    return model, norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping active, and a no-op
def test_fast_path_matches_unscale_then_clip(norm_type: float, max_norm: float) -> None:
    ref_model, ref_norm = _reference(max_norm, norm_type)
    model, opt = _setup()
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model)
    norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_folded_fused_path_matches_unscale_then_clip() -> None:
    ref_model, ref_norm = _reference(0.5, 2.0, fused=True)
    model, opt = _setup(fused=True)
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model)
    grads_before = [g.clone() for g in gradients(opt.param_groups)]
    norm = scaler.clip_grad_norm_(opt, 0.5)
    for g, before in zip(gradients(opt.param_groups), grads_before, strict=True):
        assert torch.equal(g, before)  # folded: no pass over the gradients
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_plain_path_after_unscale_is_bit_identical(fused: bool) -> None:
    ref_model, ref_norm = _reference(0.5, 2.0, fused=fused)
    model, opt = _setup(fused=fused)
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model)
    scaler.unscale_(opt)
    norm = scaler.clip_grad_norm_(opt, 0.5)
    assert torch.equal(norm, ref_norm)
    scaler.step(opt)
    scaler.update()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_overflowing_step_is_still_skipped_after_clipping(fused: bool, unscale_first: bool) -> None:
    model, opt = _setup(fused=fused)
    before = copy.deepcopy(model.state_dict())
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model, poison=True)
    if unscale_first:
        scaler.unscale_(opt)
    norm = scaler.clip_grad_norm_(opt, 0.5)
    assert not torch.isfinite(norm)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == SCALE / 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert opt.state_dict()["state"] == {} or all(
        int(s["step"]) == 0 for s in opt.state_dict()["state"].values()
    )


def test_clipping_twice_composes() -> None:
    model, opt = _setup(fused=True)
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model)
    first = scaler.clip_grad_norm_(opt, 2.0)
    second = scaler.clip_grad_norm_(opt, 0.5)
    assert first > 2.0
    torch.testing.assert_close(second, torch.tensor(2.0), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fold_first", [False, True])
def test_clip_grad_value_acts_on_unscaled_gradients(fold_first: bool) -> None:
    model, opt = _setup(fused=fold_first)
    ref_model, ref_opt = _setup(fused=fold_first)
    scaler, ref = LossScaler(init_scale=SCALE), torch.amp.GradScaler("cpu", init_scale=SCALE)
    _backward(scaler, model)
    _backward(ref, ref_model)
    ref.unscale_(ref_opt)
    if fold_first:
        scaler.clip_grad_norm_(opt, 1e6)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e6)
    scaler.clip_grad_value_(opt, 0.01)
    torch.nn.utils.clip_grad_value_(ref_model.parameters(), 0.01)
    for g, r in zip(gradients(opt.param_groups), gradients(ref_opt.param_groups), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=0)
    assert max(g.abs().max().item() for g in gradients(opt.param_groups)) == pytest.approx(0.01)


def test_error_if_nonfinite() -> None:
    model, opt = _setup()
    scaler = LossScaler(init_scale=SCALE)
    _backward(scaler, model, poison=True)
    with pytest.raises(RuntimeError, match=r"non-finite.*HINT"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


def test_disabled_scaler_clips_like_torch() -> None:
    model, opt = _setup()
    ref_model, _ = _setup()
    _backward(LossScaler(enabled=False), model)
    _backward(LossScaler(enabled=False), ref_model)
    norm = LossScaler(enabled=False).clip_grad_norm_(opt, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
    assert torch.equal(norm, ref_norm)


def test_clip_function_on_fp16_gradients_keeps_fp32_norm() -> None:
    grads = [torch.full((100,), 60000.0, dtype=torch.float16)]
    result = clip_grad_norm_(get_kernels("torch"), grads, 1.0, grad_scale=torch.tensor(2.0**16))
    assert result.total_norm.dtype == torch.float32 and torch.isfinite(result.total_norm)
    assert result.found_inf.item() == 0.0
    torch.testing.assert_close(grads[0].float().norm(), torch.tensor(1.0), rtol=2e-3, atol=0)


def test_sparse_gradients_are_rejected() -> None:
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match=r"sparse.*HINT"):
        gradients([{"params": list(emb.parameters())}])


# -- the read-only inf check of a step that clips nothing ----------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_nonfinite_flags_exactly_the_gradients_with_an_inf_or_nan(
    device: str, dtype: torch.dtype, bad: float | None
) -> None:
    grads = [torch.randn(3, 5, device=device).to(dtype), torch.randn(7, device=device), torch.ones(0)]
    if bad is not None:
        grads[0][2, 1] = bad
    before = [_bits(g) for g in grads]
    flag = nonfinite(grads, torch.ones((), device=device))
    assert flag.dtype == torch.float32 and flag.shape == () and flag.device.type == device
    assert flag.item() == (0.0 if bad is None else 1.0)  # exactly 1: a fused optimizer skips on == 1
    assert all(torch.equal(b, _bits(g)) for b, g in zip(before, grads, strict=True))  # read only


def test_a_guarded_bf16_step_never_hands_bf16_to_torch_amp_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA torch's AMP inf check has no bf16 kernel; the guard's check gives it fp32 norms only."""
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def like_cuda(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise NotImplementedError("_amp_foreach_non_finite_check_cuda not implemented for 'BFloat16'")
        real(tensors, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", like_cuda)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    for fused, value in [(False, 1.0), (False, float("nan")), (True, 1.0), (True, float("inf"))]:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        guard = LossScaler(init_scale=1.0, dynamic=False)
        before = [p.detach().clone() for p in model.parameters()]
        guard.scale(model(torch.full((2, 3), value, dtype=torch.bfloat16)).sum()).backward()
        guard.step(opt)
        guard.update()
        changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert guard.last_step_skipped == (value != 1.0) and changed == (value == 1.0)
        opt.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_check_by_rewrite_leaves_every_value_bit_for_bit(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    special = torch.tensor([-0.0, 0.0, info.tiny / 4, -info.tiny / 2, info.max, -info.max, 1.0], dtype=dtype)
    grads = [special, torch.randn(5, 7).to(dtype), torch.empty(0, dtype=dtype)]
    before = [_bits(g).clone() for g in grads]
    found_inf = torch.zeros(())
    assert rewrite_pays(grads, found_inf)
    get_kernels("torch").unscale_(grads, torch.ones(()), found_inf)  # the check by rewrite
    assert found_inf.item() == 0.0
    assert all(torch.equal(_bits(g), b) for g, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_the_check_by_rewrite_finds_what_the_norm_finds(bad: float) -> None:
    grads = [torch.randn(3, 4), torch.randn(6).half()]
    grads[1][2] = bad
    found_inf = torch.zeros(())
    assert rewrite_pays(grads, found_inf)
    get_kernels("torch").unscale_(grads, torch.ones(()), found_inf)
    assert found_inf.item() == 1.0 == nonfinite([g.clone() for g in grads], torch.ones(())).item()


def test_the_check_by_rewrite_declines_large_gradients() -> None:
    grads = [torch.zeros(1 << 22), torch.zeros((1 << 22) + 1)]  # one element over the limit
    assert rewrite_pays(grads[:1], torch.zeros(()))
    assert not rewrite_pays(grads, torch.zeros(()))


@pytest.mark.parametrize("clip", [0.0, 0.25, 3.0])
def test_clamp_is_torchs_clip_grad_value(clip: float) -> None:
    torch.manual_seed(0)
    values = [torch.randn(4, 3) * 2, torch.randn(5).half(), torch.tensor([float("nan"), -float("inf"), 1e4])]
    params = [nn.Parameter(torch.zeros_like(v)) for v in values]
    for p, v in zip(params, values, strict=True):
        p.grad = v.clone()
    torch.nn.utils.clip_grad_value_(params, clip)
    mine = [v.clone() for v in values]
    clamp_(mine, clip)
    assert all(torch.equal(_bits(m), _bits(p.grad)) for m, p in zip(mine, params, strict=True))


def test_an_expanded_gradient_is_checked_by_its_norm_instead() -> None:
    """A hook may put a gradient that cannot be written in place (an expanded view) after unscale_."""
    model, opt = _setup()
    scaler = LossScaler("cpu", init_scale=SCALE)
    _backward(scaler, model)
    scaler.unscale_(opt)
    model[2].bias.grad = torch.tensor(float("inf")).expand(4)  # one memory location, four elements
    scaler.recheck_(opt)
    found = scaler.found_inf(opt)
    assert found is not None and found.item() == 1.0
