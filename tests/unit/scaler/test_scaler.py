"""LossScaler against torch.amp.GradScaler as the oracle, plus its own policies and errors."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from amp_plugin._optim import unwrap_optimizer
from tests._scaler_twins import same_bits

OptFactory = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptFactory] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}
POISON = (float("inf"), float("-inf"), float("nan"))


def _two_part_model() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"a": nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)), "b": nn.Linear(4, 1)}
    )


def _poison(grads: list[torch.Tensor], rng: random.Random) -> None:
    where = rng.choice(("first", "last", "middle"))
    value = rng.choice(POISON)
    if where == "first":
        grads[0].view(-1)[0] = value
    elif where == "last":
        grads[-1].view(-1)[-1] = value
    else:
        mid = grads[len(grads) // 2].view(-1)
        mid[mid.numel() // 2] = value


def _run(scaler: Any, opt_factory: OptFactory, steps: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Train a two-optimizer model on ``device`` with 2 micro-batches per step and injected overflows."""
    torch.manual_seed(seed)
    model = _two_part_model().to(device)
    opts = [opt_factory(model["a"].parameters()), opt_factory(model["b"].parameters())]
    rng = random.Random(seed)
    data = torch.randn(steps, 2, 5, 6).to(device)
    scales = []
    for step in range(steps):
        for micro in range(2):
            loss = model["b"](model["a"](data[step, micro])).pow(2).mean()
            scaler.scale(loss).backward()
        if rng.random() < 0.15:
            _poison([p.grad for p in model[rng.choice("ab")].parameters()], rng)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    return {"model": model, "opts": opts, "scales": scales}


def _assert_bit_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["scales"] == b["scales"]
    for pa, pb in zip(a["model"].parameters(), b["model"].parameters(), strict=True):
        assert torch.equal(pa, pb)
    for oa, ob in zip(a["opts"], b["opts"], strict=True):
        for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
            assert sa.keys() == sb.keys()
            for key in sa:
                assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bit_identical_to_torch_grad_scaler(name: str, device: str) -> None:
    kwargs = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7}
    ours = LossScaler(**kwargs)  # device=None: it takes the device of the first loss
    theirs = torch.amp.GradScaler(device, **kwargs)
    a, b = _run(ours, OPTIMIZERS[name], 300, device), _run(theirs, OPTIMIZERS[name], 300, device)
    _assert_bit_identical(a, b)
    assert len(set(a["scales"])) > 3  # the scale both grew and backed off
    assert 20 < ours.skipped_steps < 80
    assert ours.total_steps == 300


def test_skipped_fused_step_leaves_params_and_state_untouched() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = LossScaler(init_scale=4.0)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    for p, q in zip(model.parameters(), before[0], strict=True):
        assert torch.equal(p, q)
    state, old = opt.state_dict()["state"], before[1]["state"]
    for key in state:
        for name in state[key]:
            assert torch.equal(state[key][name], old[key][name]), name
    assert scaler.get_scale() == 2.0


def _scales_for(pattern: str, **kwargs: Any) -> list[float]:
    """Drive update() with an overflow pattern ('x' overflow, '.' clean); return the scales."""
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = LossScaler(**kwargs)
    out = []
    for ch in pattern:
        scaler.scale(param.sum() + 1.0).backward()
        if ch == "x":
            param.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
        opt.zero_grad()
    return out


def test_hysteresis_backs_off_only_at_the_hth_overflow_in_a_row() -> None:
    scales = _scales_for("x.xx.xxxx", init_scale=64.0, hysteresis=2, growth_interval=1000)
    assert scales == [64, 64, 64, 32, 32, 32, 16, 8, 4]


def test_hysteresis_resets_growth_tracker_on_absorbed_overflow() -> None:
    scales = _scales_for("..x..", init_scale=8.0, hysteresis=3, growth_interval=3)
    assert scales == [8, 8, 8, 8, 8]  # the absorbed overflow restarts the growth count
    assert _scales_for("...", init_scale=8.0, hysteresis=3, growth_interval=3) == [8, 8, 16]


def test_hysteresis_one_equals_torch_sequence() -> None:
    assert _scales_for("x.x..", init_scale=64.0, growth_interval=2) == [32, 32, 16, 16, 32]


def test_min_and_max_scale_clamp() -> None:
    assert _scales_for("xxxx", init_scale=8.0, min_scale=2.0) == [4, 2, 2, 2]
    assert _scales_for("....", init_scale=8.0, growth_interval=1, max_scale=32.0) == [16, 32, 32, 32]


def test_static_scaling_keeps_the_scale_but_still_skips() -> None:
    scaler_scales = _scales_for("x..x", init_scale=8.0, dynamic=False, growth_interval=1)
    assert scaler_scales == [8, 8, 8, 8]


def test_scale_never_grows_to_inf() -> None:
    assert _scales_for("..", init_scale=2.0**127, growth_interval=1)[-1] == 2.0**127


def test_state_dict_round_trip_reproduces_the_trajectory() -> None:
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 5, "hysteresis": 2, "min_scale": 1.0}
    full = _run(LossScaler(**kwargs), OPTIMIZERS["adam"], 60, "cpu", seed=3)

    # Run 30 steps, save everything, and continue in fresh objects from the saved state.
    first = LossScaler(**kwargs)
    part = _run(first, OPTIMIZERS["adam"], 60, "cpu", seed=3)  # same seed → same data and poison
    assert part["scales"] == full["scales"]
    sd = first.state_dict()
    resumed = LossScaler()
    resumed.load_state_dict(sd)
    assert resumed.state_dict() == sd
    assert resumed.get_scale() == full["scales"][-1]
    assert resumed.skipped_steps == first.skipped_steps and resumed.total_steps == 60


def test_state_dict_resume_mid_run_bit_identical() -> None:
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 4, "hysteresis": 2}
    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    data = torch.randn(40, 3, 4)
    poison_at = {3, 4, 11, 25, 26, 27, 33}

    def train(scaler: LossScaler, m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        out = []
        for step in steps:
            scaler.scale(m(data[step]).pow(2).mean()).backward()
            if step in poison_at:
                m.bias.grad.fill_(float("nan"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(scaler.get_scale())
        return out

    m1 = copy.deepcopy(model)
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-2)
    s1 = LossScaler(**kwargs)
    full = train(s1, m1, o1, range(40))

    m2 = copy.deepcopy(model)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    s2 = LossScaler(**kwargs)
    head = train(s2, m2, o2, range(26))  # stop between two overflows absorbed by hysteresis
    ckpt = copy.deepcopy({"m": m2.state_dict(), "o": o2.state_dict(), "s": s2.state_dict()})
    m3 = copy.deepcopy(model)
    m3.load_state_dict(ckpt["m"])
    o3 = torch.optim.Adam(m3.parameters(), lr=1e-2)
    o3.load_state_dict(ckpt["o"])
    s3 = LossScaler()
    s3.load_state_dict(ckpt["s"])
    tail = train(s3, m3, o3, range(26, 40))
    assert head + tail == full
    for p, q in zip(m1.parameters(), m3.parameters(), strict=True):
        assert torch.equal(p, q)
    assert s3.skipped_steps == s1.skipped_steps == len(poison_at) and s3.total_steps == 40


def test_loads_a_torch_grad_scaler_state_dict() -> None:
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=9)
    torch_scaler.scale(torch.ones(()))
    sd = torch_scaler.state_dict()
    ours = LossScaler()
    ours.load_state_dict(sd)
    assert ours.get_scale() == 512.0 and ours.get_growth_interval() == 9
    assert torch_scaler.state_dict() == {k: ours.state_dict()[k] for k in sd}


def test_fp16_loss_is_upcast_before_scaling() -> None:
    """The one deliberate difference from GradScaler (a 0-dim fp16 loss is promoted by both)."""
    scalar = torch.tensor(3.7, dtype=torch.float16)
    theirs, ours = torch.amp.GradScaler("cpu", init_scale=2.0**16), LossScaler(init_scale=2.0**16)
    assert same_bits(ours.scale(scalar), theirs.scale(scalar))

    loss = torch.tensor([10.0, 0.5, -3.0], dtype=torch.float16)
    from_torch, from_ours = theirs.scale(loss), ours.scale(loss)
    # torch keeps fp16 (and overflows), LossScaler upcasts to fp32 first: the trap it avoids
    assert from_torch.dtype == torch.float16 and not torch.isfinite(from_torch).all()
    assert from_ours.dtype == torch.float32 and torch.isfinite(from_ours).all()
    assert same_bits(from_ours, loss.float() * 2.0**16)


def test_scale_rejects_what_is_not_a_tensor_or_a_nesting_of_tensors() -> None:
    # nested lists and tuples: test_scaler_conformance.py, bit for bit against GradScaler
    scaler = LossScaler(init_scale=2.0)
    with pytest.raises(
        TypeError, match=r"scale\(outputs=float\) is not allowed here: "
            r".*a tensor or a list/tuple of tensors\. HINT"
    ):
        scaler.scale(3.0)


class _Wrapper:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self) -> None:
        self._optimizer.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups


def test_wrapper_and_inner_optimizer_share_one_state() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    grad = model.weight.grad.clone()
    scaler.unscale_(_Wrapper(opt))
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    assert torch.equal(model.weight.grad, grad / 4)  # unscaled once, not twice
    assert unwrap_optimizer(_Wrapper(opt)) is opt


def test_lightning_optimizer_is_unwrapped() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    assert unwrap_optimizer(LightningOptimizer(opt)) is opt


def test_grad_scaler_unscales_a_lightning_optimizer_and_its_optimizer_twice() -> None:
    """comparison.md, torch's cell: GradScaler keys its state by id(optimizer), so the wrapper that
    Lightning hands the user and the optimizer inside it are two optimizers to it."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    grad = model.weight.grad.clone()
    scaler.unscale_(LightningOptimizer(opt))
    scaler.unscale_(opt)  # no error
    assert torch.equal(model.weight.grad, grad / 16)  # divided by the scale twice


def test_unwrap_rejects_non_optimizers() -> None:
    with pytest.raises(TypeError, match=r"Expected a torch\.optim\.Optimizer"):
        unwrap_optimizer(object())


def _scaled_backward(scaler: LossScaler) -> torch.optim.Optimizer:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    return opt


def test_misuse_errors_name_the_call_and_the_fix() -> None:
    scaler = LossScaler()
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was called before scale\(\). HINT"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"update\(\) was called before scale"):
        scaler.update()
    with pytest.raises(RuntimeError, match=r"recheck_\(\) was called before scale\(\). HINT"):
        scaler.recheck_(opt)
    opt = _scaled_backward(scaler)
    with pytest.raises(RuntimeError, match=r"No inf checks were recorded prior to update\. .*HINT"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called.*HINT"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called.*HINT: call update"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\. HINT"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) was called after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: None)


_MISUSES: dict[str, Callable[[Any, torch.optim.Optimizer], Any]] = {
    "unscale twice": lambda scaler, opt: (scaler.unscale_(opt), scaler.unscale_(opt)),
    "step twice": lambda scaler, opt: (scaler.step(opt), scaler.step(opt)),
    "unscale after step": lambda scaler, opt: (scaler.step(opt), scaler.unscale_(opt)),
    "step with a closure": lambda scaler, opt: scaler.step(opt, closure=lambda: None),
    "update without a step": lambda scaler, opt: scaler.update(),
}


@pytest.mark.parametrize("misuse", sorted(_MISUSES))
def test_order_errors_begin_with_grad_scalers_own_sentence(misuse: str) -> None:
    # Code written against torch.amp.GradScaler that matches its messages keeps matching; the
    # HINT comes after torch's words.
    messages = []
    for scaler in (torch.amp.GradScaler("cpu"), LossScaler("cpu")):
        opt = _scaled_backward(scaler)
        with pytest.raises((RuntimeError, AssertionError)) as raised:  # torch asserts a few
            _MISUSES[misuse](scaler, opt)
        messages.append(str(raised.value))
    torch_says, we_say = messages
    assert we_say.startswith(torch_says), (torch_says, we_say)
    assert "HINT:" in we_say[len(torch_says) :]


def test_sync_true_without_process_group_raises_before_anything_is_scaled() -> None:
    scaler = LossScaler("cpu", sync_found_inf=True)
    with pytest.raises(RuntimeError, match=r"not initialised.*HINT"):
        scaler.scale(torch.ones((), requires_grad=True))
    # Nothing began: no scale tensor, no iteration (a state can be loaded, the scaler pickled).
    scaler.load_state_dict(LossScaler("cpu", init_scale=8.0).state_dict())
    assert scaler.get_scale() == 8.0


def test_update_does_not_sync_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = LossScaler(hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    opt = torch.optim.AdamW(nn.Linear(2, 1).parameters(), fused=True)
    scaler.scale(opt.param_groups[0]["params"][0].sum()).backward()

    def no_sync(self: torch.Tensor) -> Any:
        raise AssertionError("host sync")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)  # the fused path decides inside the kernel: no sync either
    scaler.update()


@pytest.mark.filterwarnings("ignore::amp_plugin._scale_policy.ScaleFloorWarning")  # min_scale reaches it
@pytest.mark.parametrize("settings", [{}, {"max_scale": 2.0**10}, {"min_scale": 1.0}])
def test_the_short_path_of_update_changes_nothing(settings: dict[str, Any]) -> None:
    """Updates known clean on the host skip the floor and skip bookkeeping; the full rule gives the same."""
    from amp_plugin._scale_policy import DynamicScale

    rng = random.Random(0)
    flags = [float(rng.random() < 0.3) for _ in range(300)]

    def run(known: bool) -> list[Any]:
        policy = DynamicScale(2.0**8, 2.0, 0.5, 3, **settings)
        policy.ensure(torch.device("cpu"))
        states = []
        for flag in flags:
            policy.update_(torch.tensor(flag), bool(flag) if known else None)
            states.append((policy.state_dict(), int(policy.floor_step), policy.last_skipped()))
        return states

    assert run(known=True) == run(known=False)


def test_a_scaled_loss_backpropagates_in_torch_alone_and_poisons_a_non_finite_loss() -> None:
    """The scaled loss is a plain product (C++ autograd, no Python per backward, as GradScaler's),
    its gradients are GradScaler's bit for bit, and an inf/NaN loss still makes them NaN (its step
    must be skipped even where no parameter sees the non-finite term)."""
    w = nn.Parameter(torch.tensor([1.5, -2.0]))
    ours, theirs = LossScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled = ours.scale((w * 3.0).sum())
    assert type(scaled.grad_fn).__name__ == "MulBackward0"
    scaled.backward()
    mine, w.grad = w.grad, None
    theirs.scale((w * 3.0).sum()).backward()
    assert torch.equal(mine, w.grad)
    w.grad = None
    ours.scale((w * 3.0).sum() + torch.tensor(float("inf"))).backward()
    assert w.grad is not None and w.grad.isnan().all()


@pytest.mark.parametrize("ours", [True, False], ids=["LossScaler", "GradScaler"])
def test_clip_grad_value_finds_an_inf_written_after_unscale_before_clamping(ours: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler: Any = LossScaler("cpu", init_scale=4.0) if ours else torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    model.weight.grad[0, 0] = float("inf")  # a hook or penalty, after unscale_
    if ours:
        scaler.clip_grad_value_(opt, 0.5)  # would clamp the inf to 0.5
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)  # torch's recipe
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    # ours skips the step; torch's steps with the inf clamped to 0.5
    assert torch.equal(model.weight, before) is ours


@pytest.mark.parametrize("path", ["clip", "unscale-clip", "guard", "fused", "grad_norm"])
def test_an_fp64_model_takes_every_scaler_path(path: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    opt = torch.optim.AdamW(model.parameters(), fused=path == "fused")
    scaler = LossScaler("cpu", init_scale=1.0, dynamic=False) if path == "guard" else LossScaler("cpu")
    scaler.scale(model(torch.ones(4, 3, dtype=torch.float64)).square().sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    if path == "unscale-clip":
        scaler.unscale_(opt)
    if path in ("clip", "unscale-clip"):
        assert scaler.clip_grad_norm_(opt, 1.0).dtype == torch.float64
    if path == "grad_norm":
        assert torch.isfinite(scaler.grad_norm(opt))
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "1", "1x1"])
@pytest.mark.parametrize("init_scale", [2.0**16, 1.0, 3.0], ids=["fp16-scale", "guard", "odd"])
def test_backward_seed_gives_the_scaled_loss_gradients_bit_for_bit(
    device: str, dtype: torch.dtype, shape: tuple[int, ...], init_scale: float
) -> None:
    """``loss.backward(gradient=scaler.backward_seed(loss))`` is ``scale(loss).backward()`` in one launch."""
    w = nn.Parameter(torch.tensor([1.5, -2.0, 0.25], device=device))

    def loss() -> torch.Tensor:
        return (w.to(dtype) * 3.0).sum().reshape(shape)

    kwargs = {"dynamic": False} if init_scale == 1.0 else {}
    scaler = LossScaler(device, init_scale=init_scale, **kwargs)  # type: ignore[arg-type]
    scaler.scale(loss()).backward()
    expected, w.grad = w.grad, None
    seeded = loss()
    seed = scaler.backward_seed(seeded)
    # In the loss's own dtype: autograd would otherwise cast it (a launch more, the same rounding).
    assert seed.shape == seeded.shape and seed.dtype == dtype and not seed.requires_grad
    seeded.backward(gradient=seed)
    assert same_bits(w.grad, expected)


@pytest.mark.parametrize("init_scale", [2.0**16, 1.0], ids=["fp16", "guard"])
def test_backward_seed_makes_a_nan_loss_with_finite_gradients_skip_its_step(init_scale: float) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", init_scale=init_scale, dynamic=init_scale != 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(3, 4)).sum() + torch.log(torch.tensor(-1.0))  # NaN; its gradients are finite
    loss.backward(gradient=scaler.backward_seed(loss))
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_backward_seed_refuses_what_backward_would_not_seed_implicitly() -> None:
    scaler = LossScaler("cpu")
    shape = r"(?s)loss=Tensor of shape \(2,\).*one element.*HINT: .*scale\(loss\)"
    with pytest.raises(ValueError, match=shape):
        scaler.backward_seed(torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match=r"(?s)loss=int.*floating-point tensor.*HINT: .*scale\(loss\)"):
        scaler.backward_seed(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"(?s)dtype=torch.int64.*floating-point tensor"):
        scaler.backward_seed(torch.tensor(3))
    assert scaler.state_dict()["scale"] == 2.0**16


def test_a_disabled_scaler_seeds_backward_with_ones() -> None:
    seed = LossScaler("cpu", enabled=False).backward_seed(torch.tensor(float("nan"), requires_grad=True))
    assert torch.equal(seed, torch.ones(()))
