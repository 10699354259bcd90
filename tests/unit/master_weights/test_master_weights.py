"""fp32 master weights for half models: casting, optimizer hand-over, per-step copies, skips, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler
from amp_plugin.master_weights import NORM_LAYERS, MasterWeights, cast_model, masters_of


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2), nn.BatchNorm1d(2))


def _step(
    model: nn.Module, masters: MasterWeights, opt: torch.optim.Optimizer, scaler: LossScaler | None = None
) -> None:
    opt.zero_grad()
    x = torch.randn(16, 4, dtype=masters.dtype)
    loss = model(x).float().square().mean()
    if scaler is None:
        loss.backward()
        masters.grads_to_master()
        opt.step()
    else:
        scaler.scale(loss).backward()
        masters.grads_to_master()
        scaler.step(opt)
        scaler.update()


# ---------------------------------------------------------------- casting


def test_cast_keeps_norm_layers_and_makes_exact_masters() -> None:
    model = _model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = cast_model(model, torch.float16)
    assert model[0].weight.dtype == torch.float16 and model[3].bias.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[4].running_var.dtype == torch.float32
    assert len(masters) == 4  # the two Linear layers' weights and biases
    by_name = {names[0]: m for m, names in zip(masters.masters(), masters.names.values(), strict=True)}
    for name, master in by_name.items():
        assert master.dtype == torch.float32
        assert torch.equal(master, original[name]), name  # not a round trip through fp16


def test_cast_everything_with_no_kept_classes_and_leave_fp64_alone() -> None:
    model = _model()
    model.register_buffer("table", torch.ones(3, dtype=torch.float64))
    cast_model(model, torch.bfloat16, keep_fp32=())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.table.dtype == torch.float64
    assert model[4].running_mean.dtype == torch.bfloat16


def test_tied_weights_stay_tied_and_share_one_master() -> None:
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    masters = cast_model(model, torch.float16)
    assert model[0].weight is model[1].weight and model[0].weight.dtype == torch.float16
    assert len(masters) == 1
    assert sorted(next(iter(masters.names.values()))) == ["0.weight", "1.weight"]


def test_frozen_parameters_are_cast_without_a_master() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    masters = cast_model(model, torch.float16)
    assert model[0].weight.dtype == torch.float16 and len(masters) == 3


def test_pure_half_cast_has_no_masters() -> None:
    model = _model()
    assert len(cast_model(model, torch.bfloat16, master_weights=False)) == 0
    assert model[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": "model"}, TypeError, r"cast_model\(module='model'\).*HINT"),
        ({"dtype": torch.float32}, TypeError, r"dtype=torch.float32.*float16 or torch.bfloat16.*HINT"),
        ({"keep_fp32": nn.LayerNorm}, TypeError, r"HINT: wrap the class in a tuple"),
        ({"keep_fp32": (nn.LayerNorm(2),)}, TypeError, r"is an instance; pass its class"),
    ],
)
def test_bad_cast_arguments_raise_and_change_nothing(kwargs: dict, error: type, match: str) -> None:
    model = _model()
    args = {"module": model, "dtype": torch.float16, **kwargs}
    with pytest.raises(error, match=match):
        cast_model(**args)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# ---------------------------------------------------------------- the optimizer


def test_attach_moves_params_and_state_to_masters_and_detach_undoes_it() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()  # momentum state exists for the fp32 parameters
    halves = [p for g in opt.param_groups for p in g["params"]]
    masters = cast_model(model, torch.float16)
    masters.attach(opt)
    masters.attach(opt)  # a second attach changes nothing
    params = [p for g in opt.param_groups for p in g["params"]]
    assert sum(p.dtype == torch.float32 and p not in set(model.parameters()) for p in params) == 4
    assert all(p in opt.state for p in params)
    masters.detach(opt)
    assert [p for g in opt.param_groups for p in g["params"]] == halves
    assert all(p in opt.state for p in halves)
    assert "zero_grad" not in vars(opt)


def test_zero_grad_also_clears_the_half_gradients() -> None:
    model = _model()
    masters = cast_model(model, torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters.attach(opt)
    model(torch.randn(4, 4, dtype=torch.float16)).float().sum().backward()
    opt.zero_grad()  # a backward that is never stepped must not leak into the next step
    assert model[0].weight.grad is None
    model(torch.randn(4, 4, dtype=torch.float16)).float().sum().backward()
    opt.zero_grad(set_to_none=False)
    assert model[0].weight.grad is not None and not model[0].weight.grad.any()


def test_gradients_accumulate_in_fp32_across_backwards_and_steps() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    masters = cast_model(model, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    masters.attach(opt)
    x = torch.randn(8, 4)
    for _ in range(2):  # two backwards, two transfers, no zero_grad: the master grads add up
        model(x.bfloat16()).float().sum().backward()
        masters.grads_to_master()
        ref(x).sum().backward()
    master = next(iter(masters.masters()))
    assert model[0].weight.grad is None
    torch.testing.assert_close(master.grad, ref[0].weight.grad, rtol=2e-2, atol=2e-2)


def test_masters_move_where_half_weights_would_stall() -> None:
    """The weight-backup effect: 100 updates of 1e-4 on a weight of 1.0 (fp16 spacing there is ~1e-3)."""
    finals = {}
    for keep_masters in (True, False):
        w = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            w.weight.fill_(1.0)
        masters = cast_model(w, torch.float16, master_weights=keep_masters)
        opt = torch.optim.SGD(w.parameters(), lr=1e-4)
        masters.attach(opt)
        for _ in range(100):
            opt.zero_grad()
            w.weight.grad = torch.ones_like(w.weight)
            masters.grads_to_master()
            opt.step()
        finals[keep_masters] = w.weight.item()
    assert finals[False] == 1.0
    assert finals[True] == pytest.approx(0.99, abs=1e-3)


def test_training_with_masters_tracks_fp32() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.randn(4, 2)
    losses = {}
    for mode in ("fp32", "master"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 2))
        masters = cast_model(model, torch.float16) if mode == "master" else None
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = LossScaler("cpu") if masters else None
        if masters:
            masters.attach(opt)
        for _ in range(150):
            opt.zero_grad()
            out = model(x.half() if masters else x).float()
            loss = (out - y).square().mean()
            if masters and scaler:
                scaler.scale(loss).backward()
                masters.grads_to_master()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        losses[mode] = loss.item()
    assert losses["master"] == pytest.approx(losses["fp32"], rel=0.02)


def test_a_skipped_step_leaves_master_model_and_optimizer_state_bit_identical() -> None:
    model = _model()
    masters = cast_model(model, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    masters.attach(opt)
    scaler = LossScaler("cpu", init_scale=2.0**10)
    _step(model, masters, opt, scaler)
    before = (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in masters.masters()],
        copy.deepcopy(opt.state_dict()["state"]),
    )
    opt.zero_grad()
    loss = model(torch.randn(16, 4, dtype=torch.float16)).float().square().mean()
    scaler.scale(loss).backward()
    model[0].weight.grad[0, 0] = float("inf")
    masters.grads_to_master()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    for a, b in zip(before[0], model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(before[1], masters.masters(), strict=True):
        assert torch.equal(a, b)
    after = opt.state_dict()["state"]
    for key, state in before[2].items():
        for name, value in state.items():
            assert torch.equal(value, after[key][name]), (key, name)


def test_every_norm_layer_class_is_kept() -> None:
    layers = [nn.BatchNorm2d(2), nn.InstanceNorm1d(2, affine=True), nn.GroupNorm(1, 2), nn.LayerNorm(2)]
    layers.append(nn.RMSNorm(2))
    model = nn.Sequential(*layers)
    cast_model(model, torch.float16)
    assert all(isinstance(m, NORM_LAYERS) for m in layers)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# ---------------------------------------------------------------- checkpoints


def test_attach_refuses_a_non_optimizer() -> None:
    masters = cast_model(_model(), torch.float16)
    with pytest.raises(TypeError, match=r"Expected a torch.optim.Optimizer.*got object.*HINT"):
        masters.attach(object())


# ---------------------------------------------------------------- half models, state_dict, norm layers


def test_a_half_model_gets_fp32_masters_made_from_its_half_values() -> None:
    model = _model().half()  # model.half(), or a Hugging Face model created in fp16
    halves = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = cast_model(model, torch.float16)
    assert len(masters) == 4  # every trainable parameter outside the norm layers
    by_name = {names[0]: m for m, names in zip(masters.masters(), masters.names.values(), strict=True)}
    for name, master in by_name.items():
        assert master.dtype == torch.float32 and torch.equal(master, halves[name].float()), name
    assert model[1].weight.dtype == torch.float32 and model[4].running_var.dtype == torch.float32


def test_adamw_on_a_half_model_with_masters_stays_finite() -> None:
    model = _model().half()
    masters = cast_model(model, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in fp16; the masters are fp32
    masters.attach(opt)
    for _ in range(3):
        _step(model, masters, opt, LossScaler("cpu"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}


def test_state_dict_reports_the_masters_and_load_state_dict_fills_them() -> None:
    model = _model()
    masters = cast_model(model, torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    masters.attach(opt)
    for _ in range(3):
        _step(model, masters, opt)
    first = next(masters.masters())
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.float32 and torch.equal(state["0.weight"], first)
    assert not torch.equal(state["0.weight"], model[0].weight.float())  # more than fp16 holds
    assert torch.equal(nn.Sequential(model).state_dict()["0.0.weight"], first)  # under a prefix too
    assert model.state_dict(keep_vars=True)["0.weight"] is first
    fresh = _model()
    fresh.load_state_dict(state)  # an ordinary fp32 checkpoint
    resumed = cast_model(fresh, torch.float16)
    other_model = _model()
    other = cast_model(other_model, torch.float16)
    other_model.load_state_dict(state)  # into the masters, and rounded into the fp16 model
    for a, b, c in zip(masters.masters(), resumed.masters(), other.masters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(other_model[0].weight, model[0].weight)


def test_loading_a_wrong_master_shape_raises_before_anything_changes() -> None:
    model = _model()
    masters = cast_model(model, torch.float16)
    before = [t.detach().clone() for t in (*masters.masters(), *model.parameters())]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"] += 1.0
    state["3.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"3.weight=tensor of shape \(3, 3\).*shape \(2, 8\).*HINT"):
        model.load_state_dict(state)
    after = [*masters.masters(), *model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_second_cast_takes_the_fp32_values_of_the_first_and_replaces_it() -> None:
    model = _model()
    first = cast_model(model, torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first.attach(opt)
    for _ in range(3):
        _step(model, first, opt)
    first.detach()
    values = [m.detach().clone() for m in first.masters()]
    second = cast_model(model, torch.float16)  # a new plugin's second fit of the same model
    assert all(torch.equal(a, b) for a, b in zip(values, second.masters(), strict=True))
    with torch.no_grad():
        next(second.masters()).add_(1.0)
    assert torch.equal(model.state_dict()["0.weight"], next(second.masters()))  # the second one reports


def test_a_deep_copy_reports_its_own_masters() -> None:
    model = _model()
    masters = cast_model(model, torch.float16)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        next(masters.masters()).add_(1.0)
    assert not torch.equal(twin.state_dict()["0.weight"], model.state_dict()["0.weight"])


def test_frozen_parameters_stay_half_in_the_state_dict() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)  # a frozen base weight (LoRA): half, no master, saved as it is held
    cast_model(model, torch.float16)
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.float16 and torch.equal(state["0.weight"], model[0].weight)
    assert state["0.bias"].dtype == torch.float32


class LlamaRMSNorm(nn.Module):  # shaped like Hugging Face's: a 1-D weight, no torch norm base class
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class T5LayerNorm(LlamaRMSNorm):
    pass


class BatchNormAct2d(nn.BatchNorm2d):  # timm's: a norm layer with an activation child
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.act = nn.ReLU()


class GroupNorm32(nn.Module):  # a custom norm layer with a dimension suffix, weight and bias of its own
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(size)), nn.Parameter(torch.zeros(size))


class PreNorm(nn.Module):  # named like a norm layer, but it wraps a real layer: only its norm stays fp32
    def __init__(self, size: int) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(size), nn.Linear(size, size)


def test_norm_layers_are_recognised_by_what_they_are() -> None:
    model = nn.ModuleDict({
        "llama": LlamaRMSNorm(4), "t5": T5LayerNorm(4), "timm": BatchNormAct2d(4), "custom": GroupNorm32(4),
        "pre": PreNorm(4), "linear": nn.Linear(4, 4),
    })  # fmt: skip
    masters = cast_model(model, torch.float16)
    kept = {n: p.dtype for n, p in model.named_parameters()}
    for name in ("llama.weight", "t5.weight", "timm.weight", "timm.bias", "custom.weight", "custom.bias",
                 "pre.norm.weight", "pre.norm.bias"):  # fmt: skip
        assert kept.pop(name) == torch.float32, name
    assert model["timm"].running_mean.dtype == torch.float32
    assert set(kept.values()) == {torch.float16}, kept  # pre.fn and linear
    assert len(masters) == 4


def test_non_persistent_buffers_stay_as_they_are() -> None:
    model = nn.Linear(4, 4)
    model.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4), persistent=False)
    model.register_buffer("table", torch.ones(3))
    cast_model(model, torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32  # rotary frequencies: rounding them shifts every position
    assert model.table.dtype == torch.bfloat16


def test_masters_of_what_is_not_a_module_is_refused_with_a_hint() -> None:
    with pytest.raises(TypeError, match=r"^masters_of\(module=int\) is not allowed here: .*HINT"):
        masters_of(3)  # type: ignore[arg-type]
