"""Writing optimizer updates into half weights: nearest stalls, stochastic and Kahan keep small updates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from amp_plugin.rounded_updates import KAHAN_KEY, RoundedUpdates


def _drift(rounding: str, steps: int = 200, lr: float = 1e-4, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """A bf16 weight vector of ones after ``steps`` SGD updates of ``lr`` each (fp32 gives 1 - steps*lr)."""
    w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=lr)
    hooks = RoundedUpdates(opt, rounding, seed=seed)  # type: ignore[arg-type]
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
    hooks.remove()
    return w.detach().float()


def test_nearest_stalls_below_the_spacing_and_stochastic_follows_fp32_in_expectation() -> None:
    exact = 1 - 200 * 1e-4  # 0.98; bf16's spacing just below 1.0 is 2**-8 ~ 0.0039, so 1e-4 rounds away
    assert torch.equal(_drift("nearest"), torch.ones(4096))
    sr = _drift("stochastic")
    # Each weight is an unbiased random walk; the mean of 4096 of them is within a few standard errors.
    stderr = sr.std().item() / 4096**0.5
    assert abs(sr.mean().item() - exact) < 4 * stderr + 1e-4
    assert sr.std().item() > 0  # really random, not a deterministic rounding


def test_kahan_tracks_fp32_deterministically() -> None:
    kahan = _drift("kahan")
    assert torch.allclose(kahan, torch.full_like(kahan, 1 - 200 * 1e-4), atol=2**-8)
    assert torch.equal(kahan, _drift("kahan"))


def test_the_same_seed_gives_the_same_weights_on_every_replica() -> None:
    assert torch.equal(_drift("stochastic", steps=20, seed=3), _drift("stochastic", steps=20, seed=3))
    assert not torch.equal(_drift("stochastic", steps=20, seed=3), _drift("stochastic", steps=20, seed=4))


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "NAdam"])
def test_state_is_made_in_half_and_weights_stay_half(opt_name: str) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 3, dtype=torch.bfloat16))
    kwargs = {"momentum": 0.9} if opt_name == "SGD" else {}
    opt = getattr(torch.optim, opt_name)([w], lr=1e-3, **kwargs)
    RoundedUpdates(opt, "stochastic")
    for _ in range(3):
        w.grad = torch.randn_like(w)
        opt.step()
    assert w.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    tensors = {k: v for k, v in opt.state[w].items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    assert tensors and all(v.dtype == torch.bfloat16 for v in tensors.values()), tensors


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_step_keeps_the_hooks_on_the_parameters_gradient_accumulator(rounding: str) -> None:
    """DDP all-reduces from hooks on each parameter's gradient accumulator; a step must not replace it.

    Swapping ``p.data`` for an fp32 tensor during the step (and back) made torch build a new
    accumulator, so under DDP only the first step's gradients were averaged and the ranks drifted apart.
    """
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=1e-3)
    RoundedUpdates(opt, rounding)  # type: ignore[arg-type]
    fired: list[int] = []
    accumulator = w.view_as(w).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *_: fired.append(1))
    for step in range(3):
        (w.float() * (step + 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert fired == [1, 1, 1]
    assert w.view_as(w).grad_fn.next_functions[0][0] is accumulator
    assert w.dtype == torch.bfloat16 and set(opt.state) == {w}  # the state stays keyed by the parameter


def test_kahan_keeps_its_compensation_in_the_optimizer_state() -> None:
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=1e-4)
    RoundedUpdates(opt, "kahan")
    w.grad = torch.ones_like(w)
    opt.step()
    comp = opt.state[w][KAHAN_KEY]
    assert comp.dtype == torch.float16
    assert torch.equal(w.detach(), torch.ones(4, dtype=torch.float16))  # the write rounds to nearest
    torch.testing.assert_close(comp.float(), torch.full((4,), -1e-4), rtol=1e-3, atol=0)  # the rest


def test_a_skipped_step_changes_nothing() -> None:
    w = nn.Parameter(torch.ones(16, dtype=torch.float16))
    opt = torch.optim.AdamW([w], lr=1e-3, eps=1e-4)
    RoundedUpdates(opt, "stochastic")
    scaler = LossScaler("cpu", init_scale=4.0)
    scaler.scale(w.float().sum()).backward()
    scaler.step(opt)  # a first step, so there is optimizer state to compare
    scaler.update()
    opt.zero_grad()
    scaler.scale(w.float().sum()).backward()
    w.grad[0] = float("inf")
    before = (w.detach().clone(), copy.deepcopy(opt.state_dict()["state"]))
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert torch.equal(w.detach(), before[0])
    for key, value in before[1][0].items():
        assert torch.equal(opt.state_dict()["state"][0][key], value), key


def test_fused_optimizers_are_refused_with_a_hint() -> None:
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], fused=True)
    with pytest.raises(ValueError, match=r"fused=True.*HINT: build AdamW\(\.\.\., foreach=True\)"):
        RoundedUpdates(opt, "stochastic")
    assert not opt._optimizer_step_pre_hooks
    RoundedUpdates(opt, "nearest")  # nearest needs no hooks, so fused is fine


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((object(), "stochastic"), TypeError, r"Expected a torch.optim.Optimizer"),
        (("OPT", "round"), ValueError, r"rounding='round'.*'nearest', 'stochastic', 'kahan'.*HINT"),
        (("OPT", "stochastic", -1), ValueError, r"seed=-1.*>= 0"),
        (("OPT", "stochastic", 1.5), TypeError, r"seed=1.5"),
    ],
)
def test_bad_arguments_raise(args: tuple, error: type, match: str) -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=0.1)
    args = tuple(opt if a == "OPT" else a for a in args)
    with pytest.raises(error, match=match):
        RoundedUpdates(*args)
    assert not opt._optimizer_step_pre_hooks


def test_generator_state_round_trips_and_bad_states_are_refused() -> None:
    w = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=1e-3)
    hooks = RoundedUpdates(opt, "stochastic", seed=7)
    w.grad = torch.ones_like(w)
    opt.step()
    start, saved = w.detach().clone(), hooks.state_dict()
    opt.step()
    after = w.detach().clone()
    with torch.no_grad():
        w.copy_(start)
    hooks.load_state_dict(saved)
    opt.step()  # the same draws again: bit-identical
    assert torch.equal(w.detach(), after)
    current = hooks.state_dict()["generators"]["cpu"]
    with pytest.raises(ValueError, match=r"RoundedUpdates.load_state_dict.*HINT"):
        hooks.load_state_dict({"generators": {"cpu": "nope"}})
    assert torch.equal(hooks.state_dict()["generators"]["cpu"], current)
