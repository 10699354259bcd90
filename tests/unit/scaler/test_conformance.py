"""LossScaler is a drop-in for torch.amp.GradScaler: scenario by scenario, bit for bit.

Every scenario runs the same seeded loop twice, once under ``torch.amp.GradScaler(device)``
(the oracle) and once under ``LossScaler(device=device)``, and compares the scale after
every ``update()``, which optimizer steps were skipped, and every parameter and
optimizer-state tensor after every iteration (see ``_scaler_twins``). Where LossScaler
deliberately differs (fp16 losses are upcast) ``test_scaler.py`` asserts the documented
difference (``test_fp16_loss_is_upcast_before_scaling``, which docs/comparison.md cites).

The injected-inf, fp16-overflow, accumulation and clipping scenarios take the ``device`` fixture:
they run on the CPU and, where CUDA is available, on CUDA, where both scalers use CUDA's kernels.
The other scenarios test device-independent bookkeeping (state dicts, pickling, arguments) on the CPU.
"""

from __future__ import annotations

import inspect
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from amp_plugin import LossScaler
from tests._scaler_twins import (
    OPTIMIZERS,
    POISONS,
    WHERE,
    Scaler,
    Trace,
    assert_same_snapshots,
    assert_same_traces,
    data,
    grad_scaler,
    loss_scaler,
    mlp,
    poison,
    run_twins,
    same_bits,
    snapshot,
    step,
)

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
STEPS = 10
POISON_AT = (2, 5, 6)  # 5 and 6: two overflows in a row


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).mean()


def _torch_part(state: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, state[k]) for k in TORCH_KEYS)


# -- 1. inf/NaN injected into the gradients -----------------------------------------------


def _injected_loop(opt_name: str, where: str, value: float, device: str) -> Callable[[Scaler, str], Trace]:
    """STEPS iterations of one optimizer whose gradients get ``value`` at ``where`` in POISON_AT."""
    x = data(STEPS, device=device)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp(device=device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in POISON_AT:
                poison(params, where, value)
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
        return trace

    return loop


@pytest.mark.parametrize("value", list(POISONS))
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_injected_inf_nan_skips_and_backs_off_like_torch(
    opt_name: str, where: str, value: str, device: str
) -> None:
    loop = _injected_loop(opt_name, where, POISONS[value], device)
    theirs, _ = run_twins(loop, device, init_scale=2.0**6, growth_interval=2)
    assert [s for (s,) in theirs.skipped] == [i in POISON_AT for i in range(STEPS)]
    assert len(set(theirs.scales)) >= 3  # the scale both grew and backed off


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw-fused"])
def test_scales_that_are_no_power_of_two_unscale_like_torch(opt_name: str, device: str) -> None:
    """1 / scale rounds: LossScaler's fp32 reciprocal gives GradScaler's fp64-then-fp32 bits."""
    loop = _injected_loop(opt_name, "middle", POISONS["+inf"], device)
    odd = {"init_scale": 3.0 * 2.0**10, "growth_factor": 1.7, "backoff_factor": 0.3}
    theirs, _ = run_twins(loop, device, growth_interval=2, **odd)
    assert len({s for s in theirs.scales if s != int(s) or bin(int(s)).count("1") > 1}) >= 3


@pytest.mark.parametrize("opt_name", ["adam", "adamw-fused"])
def test_overflow_of_an_fp16_autocast_backward_matches_torch(opt_name: str, device: str) -> None:
    """No injection: a huge scale overflows the fp16 backward itself until it has backed off."""
    x = data(16, seed=2, device=device)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp(device=device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        trace = Trace()
        for i in range(16):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.float16):
                out = model(x[i, 0] * 100)
            scaler.scale(out.float().pow(2).mean()).backward()
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
        return trace

    theirs, _ = run_twins(loop, device, init_scale=2.0**30, backoff_factor=0.25, growth_interval=2)
    skips = [s for (s,) in theirs.skipped]
    assert skips[0] and 3 <= sum(skips) < len(skips)


# -- 2. gradient accumulation --------------------------------------------------------------


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_gradient_accumulation_matches_torch(opt_name: str, device: str) -> None:
    micro = 3
    x = data(STEPS, micro=micro, seed=3, device=device)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp(device=device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            for m in range(micro):
                scaler.scale(_loss(model, x[i, m]) / micro).backward()
                if i in POISON_AT and m == i % micro:  # early, middle or last micro-batch
                    poison(params, WHERE[i % 3], POISONS["nan" if i % 2 else "+inf"])
            skipped = step(scaler, opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            trace.close(scaler, [opt], [skipped])
        return trace

    theirs, _ = run_twins(loop, device, init_scale=2.0**5, growth_interval=2)
    assert [s for (s,) in theirs.skipped] == [i in POISON_AT for i in range(STEPS)]


# -- 3. several losses, models and optimizers in one iteration -----------------------------


@pytest.mark.parametrize("second", ["sgd-momentum", "adamw-fused"])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_several_losses_and_optimizers_match_torch(second: str, explicit_unscale: bool) -> None:
    x, target = data(STEPS, seed=4), data(STEPS, seed=5)[..., :1]
    overflow_in = {2: 1, 5: 0, 6: 1}  # iteration -> the model whose gradients overflow

    def loop(scaler: Scaler, arm: str) -> Trace:
        models = [mlp(seed=0), mlp(seed=1)]
        opts = [OPTIMIZERS["adam"](models[0].parameters()), OPTIMIZERS[second](models[1].parameters())]
        trace = Trace()
        for i in range(STEPS):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            out0, out1 = models[0](x[i, 0]), models[1](x[i, 0])
            loss0 = (2 * out0 + 3 * out1 - target[i, 0]).pow(2).mean()
            loss1 = (3 * out0 - 5 * out1 - target[i, 0]).pow(2).mean()
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i in overflow_in:
                poison(list(models[overflow_in[i]].parameters()), "middle", float("inf"))
            if explicit_unscale:
                scaler.unscale_(opts[0])
            skipped = [step(scaler, opt) for opt in opts]
            scaler.update()
            trace.close(scaler, opts, skipped)
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    # each optimizer skips only on its own overflow; the scale backs off on either
    expected = [(overflow_in.get(i) == 0, overflow_in.get(i) == 1) for i in range(STEPS)]
    assert theirs.skipped == expected


# -- 4. gradient penalty -------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [None, torch.float16])
def test_gradient_penalty_matches_torch(autocast: torch.dtype | None) -> None:
    x = data(STEPS, seed=6)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
                loss = _loss(model, x[i, 0])
            scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled]
            with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
                penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
                loss = loss + penalty
            scaler.scale(loss).backward()
            if i in POISON_AT:
                poison(params, WHERE[i % 3], float("nan"))
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(penalty.detach().float())
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    assert [s for (s,) in theirs.skipped] == [i in POISON_AT for i in range(STEPS)]


# -- 5. clipping ---------------------------------------------------------------------------


def _clipping_loop(
    max_norm: float, opt_name: str, use_scaler_clip: bool, device: str
) -> Callable[[Scaler, str], Trace]:
    x = data(STEPS, seed=7, device=device)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp(device=device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0] * 3)).backward()
            if i in POISON_AT:
                poison(params, WHERE[i % 3], POISONS["-inf"])
            if use_scaler_clip and arm == "ours":
                norm = scaler.clip_grad_norm_(opt, max_norm)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(norm.detach().clone())
        return trace

    return loop


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw-fused"])
def test_unscale_then_clip_grad_norm_matches_torch_bit_for_bit(opt_name: str, device: str) -> None:
    loop = _clipping_loop(0.05, opt_name, False, device)
    theirs, _ = run_twins(loop, device, init_scale=2.0**6, growth_interval=2)
    norms = [float(n) for n, (s,) in zip(theirs.extra, theirs.skipped, strict=True) if not s]
    assert min(norms) > 0.05  # the clip was active


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw-fused"])
def test_scaler_clip_grad_norm_is_torch_recipe_up_to_rounding(opt_name: str, device: str) -> None:
    kwargs = {"init_scale": 2.0**6, "growth_interval": 2}
    theirs = _clipping_loop(0.05, opt_name, True, device)(grad_scaler(device, **kwargs), "torch")
    ours = _clipping_loop(0.05, opt_name, True, device)(loss_scaler(device, **kwargs), "ours")
    assert ours.scales == theirs.scales
    assert ours.skipped == theirs.skipped
    for a, b in zip(theirs.states[-1][0], ours.states[-1][0], strict=True):
        assert a[0] == b[0]
        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-6, msg=a[0])
    for (skipped,), a, b in zip(theirs.skipped, theirs.extra, ours.extra, strict=True):
        if not skipped:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=0)


# -- 6. state_dict / load_state_dict --------------------------------------------------------


def _checkpoint_loop(
    swap_at: frozenset[int] = frozenset(), swap: Callable[[Scaler], Scaler] | None = None
) -> Callable[[Scaler, str], Trace]:
    """The injection loop; in the "ours" arm the scaler is replaced by ``swap(scaler)`` before ``swap_at``."""
    x = data(STEPS + 4, seed=8)
    poison_at = {2, 5, 6, 9}

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS + 4):
            if arm == "ours" and i in swap_at and swap is not None:
                scaler = swap(scaler)
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in poison_at:
                poison(params, "last", float("nan"))
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(_torch_part(scaler.state_dict()))
        return trace

    return loop


# growth_interval=3: at 4 the growth tracker is 1, at 7 the scale has just backed off, at 12 it grew
SWAP_AT = frozenset({4, 7, 12})
GROWING = {"init_scale": 2.0**6, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 3}


def _reloaded_into(make: Callable[[], Scaler]) -> Callable[[Scaler], Scaler]:
    """A swap that carries a scaler's state dict into a fresh scaler made with default arguments."""

    def swap(scaler: Scaler) -> Scaler:
        fresh = make()  # default arguments: everything must come from the state dict
        fresh.load_state_dict(scaler.state_dict())
        return fresh

    return swap


def test_state_dict_round_trip_mid_run_continues_identically() -> None:
    theirs, _ = run_twins(_checkpoint_loop(SWAP_AT, _reloaded_into(loss_scaler)), **GROWING)
    assert len(set(theirs.scales)) >= 4


def test_loss_scaler_continues_from_a_grad_scaler_state_dict() -> None:
    theirs = _checkpoint_loop()(grad_scaler(**GROWING), "torch")
    # the "ours" arm runs GradScaler for 7 iterations, then LossScaler from its state dict
    ours = _checkpoint_loop(frozenset({7}), _reloaded_into(loss_scaler))(grad_scaler(**GROWING), "ours")
    assert_same_traces(theirs, ours)


def test_grad_scaler_continues_from_a_loss_scaler_state_dict() -> None:
    theirs = _checkpoint_loop()(grad_scaler(**GROWING), "torch")
    ours = _checkpoint_loop(frozenset({7}), _reloaded_into(grad_scaler))(loss_scaler(**GROWING), "ours")
    assert_same_traces(theirs, ours)


# -- 7. pickling ---------------------------------------------------------------------------


def _pickled(scaler: Scaler) -> Scaler:
    return pickle.loads(pickle.dumps(scaler))


def test_pickled_before_first_use_runs_like_torch() -> None:
    theirs = _checkpoint_loop()(grad_scaler(**GROWING), "torch")
    ours = _checkpoint_loop()(_pickled(loss_scaler(**GROWING)), "ours")
    assert_same_traces(theirs, ours)


def test_pickled_between_iterations_continues_identically() -> None:
    run_twins(_checkpoint_loop(SWAP_AT, _pickled), **GROWING)


@pytest.mark.parametrize("after", ["unscale_", "step"])
def test_pickling_mid_iteration_raises_and_leaves_the_scaler_usable(after: str) -> None:
    x = data(3, seed=9)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        trace = Trace()
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            scaler.unscale_(opt)
            skipped = step(scaler, opt) if after == "step" else None
            if i == 1:
                if arm == "torch":
                    with pytest.raises(AssertionError, match="only be pickled at the beginning"):
                        pickle.dumps(scaler)
                else:
                    with pytest.raises(RuntimeError) as info:
                        pickle.dumps(scaler)
                    message = str(info.value)
                    assert re.search(r"(?i)pickl", message), message
                    assert re.search(r"update\(\)", message), message  # says when it is allowed
            if skipped is None:
                skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
        return trace

    run_twins(loop, init_scale=2.0**6, growth_interval=1)


# -- 8. fused optimizers and a preset optimizer.grad_scale ----------------------------------


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("unscale", ["none", "after-preset", "before-preset"])
@pytest.mark.parametrize("preset", [None, 3.0])
def test_fused_adamw_with_preset_grad_scale_matches_torch(
    preset: float | None, unscale: str, overflow: bool
) -> None:
    """A user-set ``optimizer.grad_scale`` divides the gradients the fused step sees.

    From torch's GradScaler.step: without an explicit unscale_ the optimizer gets
    ``grad_scale = scale * preset``; after unscale_ it gets the preset alone (the gradients
    are already unscaled). Either way the step sees ``gradient / preset``, whether the preset
    was set before or after unscale_, and the attribute is deleted after the step.
    """
    coeff = torch.tensor([3.0, 6.0, -3.0])

    def loop(scaler: Scaler, arm: str) -> Trace:
        p = nn.Parameter(torch.zeros(3))
        opt = torch.optim.AdamW([p], lr=0.1, betas=(0.5, 0.9), weight_decay=0.0, fused=True)
        trace = Trace()
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            scaler.scale((p * coeff).sum()).backward()
            if overflow and i == 1:
                poison([p], "middle", float("inf"))
            if unscale == "before-preset":
                scaler.unscale_(opt)
            if preset is not None:
                opt.grad_scale = torch.tensor(preset)
            if unscale == "after-preset":
                scaler.unscale_(opt)
            skipped = step(scaler, opt)
            trace.extra.append((hasattr(opt, "grad_scale"), hasattr(opt, "found_inf")))
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            if i == 0:  # the first exp_avg is (1 - beta1) * the gradient the step saw
                seen = opt.state[p]["exp_avg"] / 0.5
                assert torch.equal(seen, coeff / (preset or 1.0)), f"{arm}: the step saw {seen}"
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**4, growth_interval=1)
    assert [s for (s,) in theirs.skipped] == [overflow and i == 1 for i in range(3)]
    assert theirs.extra == [(False, False)] * 3  # no grad_scale/found_inf left on the optimizer


# -- 9. sparse gradients -------------------------------------------------------------------


class _SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, index: Tensor) -> Tensor:
        return self.head(self.embedding(index)).pow(2).mean()


@pytest.mark.parametrize("optimizers", ["sgd", "sparse-adam"])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_sparse_gradients_are_unscaled_and_checked_like_torch(
    optimizers: str, explicit_unscale: bool
) -> None:
    index = torch.randint(0, 12, (STEPS, 9), generator=torch.Generator().manual_seed(10))  # repeats

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = _SparseModel()
        if optimizers == "sgd":
            opts = [torch.optim.SGD(model.parameters(), lr=0.5)]
        else:
            opts = [
                torch.optim.SparseAdam(model.embedding.parameters(), lr=0.05),
                torch.optim.Adam(model.head.parameters(), lr=0.05),
            ]
        trace = Trace()
        for i in range(STEPS):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            scaler.scale(model(index[i])).backward()
            grad = model.embedding.weight.grad
            assert grad is not None and grad.is_sparse
            if i in POISON_AT:
                poison([model.embedding.weight], "first", POISONS["nan" if i % 2 else "-inf"])
            if explicit_unscale:
                scaler.unscale_(opts[0])
                grad = model.embedding.weight.grad
                trace.extra.append((grad.is_sparse, grad.detach().to_dense()))
            skipped = [step(scaler, opt) for opt in opts]
            scaler.update()
            trace.close(scaler, opts, skipped)
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    assert [s[0] for s in theirs.skipped] == [i in POISON_AT for i in range(STEPS)]


# -- 10. the grad_scaler= hand-off ----------------------------------------------------------


class _ScalerAwareSGD(torch.optim.SGD):
    """An optimizer that asks to be handed the scaler and unscales/skips by itself."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.received: list[Any] = []

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        self.received.append(grad_scaler)
        if grad_scaler is not None:
            grad_scaler.unscale_(self)
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                return None
        return super().step(closure)


def _is_handoff_warning(w: warnings.WarningMessage) -> bool:
    message = str(w.message)
    return (
        issubclass(w.category, FutureWarning)
        and "keyword" in message
        and re.search(r"\bgrad_scale\b", message) is not None
        and re.search(r"\bfound_inf\b", message) is not None
    )


def test_optimizer_taking_grad_scaler_gets_the_scaler_and_a_future_warning() -> None:
    x = data(STEPS, seed=11)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = _ScalerAwareSGD(model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in POISON_AT:
                poison(params, WHERE[i % 3], float("inf"))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                skipped = step(scaler, opt)
            assert opt.received[-1] is scaler, f"{arm}: step() got grad_scaler={opt.received[-1]!r}"
            assert sum(map(_is_handoff_warning, caught)) == 1, [str(w.message) for w in caught]
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
            trace.close(scaler, [opt], [skipped])
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    assert [s for (s,) in theirs.skipped] == [i in POISON_AT for i in range(STEPS)]


# -- 11. getters and setters ----------------------------------------------------------------


def test_getters_and_setters_change_the_trajectory_like_torch() -> None:
    x = data(14, seed=12)
    poison_at = {1, 6, 10, 11}
    settings = {0: (1.5, 0.75, 3), 4: (3.0, 0.25, 1), 9: (2.5, 0.125, 2)}

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(14):
            if i in settings:  # iteration 0: before the first scale()
                growth, backoff, interval = settings[i]
                scaler.set_growth_factor(growth)
                scaler.set_backoff_factor(backoff)
                scaler.set_growth_interval(interval)
            trace.extra.append(
                (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
            )
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in poison_at:
                poison(params, "first", float("nan"))
            skipped = step(scaler, opt)
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(_torch_part(scaler.state_dict()))
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    assert len(set(theirs.scales)) >= 6


# -- 12. constructor, disabled scaler, update(new_scale) ------------------------------------


def test_constructor_takes_torchs_first_six_parameters_in_order() -> None:
    names = list(inspect.signature(torch.amp.GradScaler).parameters)[:6]
    assert names == ["device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"]
    assert list(inspect.signature(LossScaler).parameters)[:6] == names


def test_positional_and_keyword_device_construct_the_same_scaler() -> None:
    positional = LossScaler("cpu", 8.0, 3.0, 0.25, 3, True)
    keyword = LossScaler(
        device="cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3
    )
    oracle = torch.amp.GradScaler("cpu", 8.0, 3.0, 0.25, 3, True)
    for scaler in (positional, keyword, oracle):
        assert scaler.is_enabled() and scaler.get_scale() == 8.0
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
            3.0,
            0.25,
            3,
        )
    theirs = _checkpoint_loop()(oracle, "torch")
    assert_same_traces(theirs, _checkpoint_loop()(positional, "ours"))
    assert_same_traces(theirs, _checkpoint_loop()(keyword, "ours"))
    assert LossScaler("cpu", init_scale=4.0).get_scale() == 4.0


class _TaggingSGD(torch.optim.SGD):
    def step(self, closure: Any = None, tag: str = "") -> Any:  # type: ignore[override]
        super().step(closure)
        return f"stepped {tag}"


@pytest.mark.parametrize("opt_name", ["plain", "fused"])
def test_step_forwards_arguments_and_returns_like_torch(opt_name: str) -> None:
    """``step(opt, *args, **kwargs)`` returns ``opt.step(*args, **kwargs)``, or None for a skipped step."""
    x = data(STEPS, seed=17)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = _TaggingSGD(model.parameters(), lr=0.05, fused=opt_name == "fused")
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in POISON_AT:
                poison(params, "middle", float("nan"))
            trace.extra.append(scaler.step(opt, None, tag=str(i)))
            scaler.update()
            trace.close(scaler, [opt], [False])
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    fused = opt_name == "fused"  # a fused optimizer always runs its step; it skips inside its kernel
    assert theirs.extra == [None if i in POISON_AT and not fused else f"stepped {i}" for i in range(STEPS)]


def test_disabled_scaler_passes_through_like_torch() -> None:
    x = data(4, seed=13)

    def loop(scaler: Scaler, arm: str) -> Trace:
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
        scaler.load_state_dict(grad_scaler(init_scale=8.0).state_dict())  # ignored when disabled
        model = mlp()
        opt = OPTIMIZERS["sgd-momentum"](model.parameters())
        trace = Trace()
        for i in range(4):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, x[i, 0])
            assert scaler.scale(loss) is loss
            outputs = [loss, (loss,)]
            assert scaler.scale(outputs) is outputs
            loss.backward()
            before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            scaler.unscale_(opt)
            assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
            weights = [p.detach().clone() for p in model.parameters()]
            assert scaler.step(opt, lambda: torch.tensor(7.0)) == torch.tensor(7.0)  # the closure's loss
            assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
            scaler.update()
            scaler.update(new_scale=4.0)
            trace.close(scaler, [opt], [False])
            trace.extra.append((scaler.get_scale(), scaler.is_enabled(), len(scaler.state_dict())))
        return trace

    theirs, _ = run_twins(loop, enabled=False)
    assert theirs.scales == [1.0] * 4


def test_update_with_new_scale_float_and_tensor_matches_torch() -> None:
    x = data(STEPS, seed=14)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, x[i, 0])).backward()
            if i in POISON_AT:
                poison(params, "middle", float("-inf"))
            skipped = step(scaler, opt)
            if i == 3:
                scaler.update(new_scale=5.0)
            elif i == 6:
                new_scale = torch.tensor(0.75)
                scaler.update(new_scale=new_scale)
                new_scale.fill_(1e6)  # the scaler copied the value, it holds no reference
            else:
                scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(_torch_part(scaler.state_dict()))
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=2)
    assert theirs.scales[3] == 5.0 and theirs.scales[6] == 0.75


# -- 13. the scale only changes in update(); scale() of nested outputs ------------


def test_the_scale_changes_only_in_update() -> None:
    x = data(4, seed=15)

    def loop(scaler: Scaler, arm: str) -> Trace:
        model = mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        params, trace = list(model.parameters()), Trace()
        for i in range(4):
            seen = [scaler.get_scale()]
            opt.zero_grad(set_to_none=True)
            scaler.scale(torch.ones(3)).mul_(5.0)  # the result is a new tensor, not the scale
            seen.append(scaler.get_scale())
            scaler.scale(_loss(model, x[i, 0])).backward()
            seen.append(scaler.get_scale())
            if i % 2:
                poison(params, "last", float("nan"))
            scaler.unscale_(opt)
            seen.append(scaler.get_scale())
            torch.nn.utils.clip_grad_norm_(params, 0.1)
            state = scaler.state_dict()
            state["scale"] = 123.0  # a copy
            seen.append(scaler.get_scale())
            skipped = step(scaler, opt)
            seen.append(scaler.get_scale())
            assert len(set(seen)) == 1, f"{arm}: the scale moved within iteration {i}: {seen}"
            scaler.update()
            trace.close(scaler, [opt], [skipped])
            trace.extra.append(tuple(seen))
        return trace

    theirs, _ = run_twins(loop, init_scale=2.0**6, growth_interval=1)
    assert theirs.scales == [128.0, 64.0, 128.0, 64.0]


def test_scale_of_nested_lists_and_tuples_matches_torch() -> None:
    g = torch.Generator().manual_seed(16)
    a, b, c, d = (torch.randn(n, generator=g) for n in (3, 1, 4, 2))
    outputs = [a, (b, [c, (d,)]), ()]
    theirs = grad_scaler(init_scale=1234.567).scale(outputs)
    ours = loss_scaler(init_scale=1234.567).scale(outputs)

    def flatten(o: Any) -> list[Any]:
        if isinstance(o, Tensor):
            return [o]
        return [type(o), len(o)] + [x for item in o for x in flatten(item)]

    flat_theirs, flat_ours = flatten(theirs), flatten(ours)
    assert len(flat_theirs) == len(flat_ours)
    for x, y in zip(flat_theirs, flat_ours, strict=True):
        assert same_bits(x, y), (x, y)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.float32])
@pytest.mark.parametrize("init_scale", [0.5, 3.0, 2.0**16])
def test_scale_of_outputs_of_other_dtypes_matches_torch(dtype: torch.dtype, init_scale: float) -> None:
    # torch multiplies by its fp32 scale under type promotion: integer outputs come back fp32 (a
    # scale of 0.5 cast to an integer first would zero them); fp64 ones stay fp64.
    outputs = torch.tensor([3, -7, 1000], dtype=dtype)
    theirs = grad_scaler(init_scale=init_scale).scale(outputs)
    ours = loss_scaler(init_scale=init_scale).scale(outputs)
    assert ours.dtype == theirs.dtype and same_bits(theirs, ours), (theirs, ours)


def test_snapshot_comparison_can_fail() -> None:
    """The comparison the scenarios rely on sees a one-ulp difference and a flipped NaN sign."""
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    a = snapshot(opt)
    with torch.no_grad():
        model[0].weight.view(-1)[0] = torch.nextafter(model[0].weight.view(-1)[0], torch.tensor(1.0))
    with pytest.raises(AssertionError, match=r"param0 differs"):
        assert_same_snapshots(a, snapshot(opt))
    nan = torch.tensor(float("nan"))
    assert same_bits(nan, nan.clone()) and not same_bits(nan, -nan)


def test_pickled_after_scale_before_unscale_as_torch_allows() -> None:
    for scaler in (torch.amp.GradScaler("cpu"), loss_scaler()):
        model = mlp()
        scaler.scale(_loss(model, data(1, seed=3)[0, 0])).backward()
        copied = _pickled(scaler)  # torch refuses only once an optimizer was unscaled or stepped
        assert copied.get_scale() == scaler.get_scale()
