"""One signature for every adapter: the Trainer's and Fabric's ``AMPPrecision`` take the same arguments.

Both hand them to one :class:`amp_plugin._run.AMPRun`, so an option one plugin takes the other takes
too, checked the same way, with the same meaning.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin._run import DEFAULTS, AMPRun, RunOptions
from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

PLUGINS = [AMPPrecision, FabricAMPPrecision]


def _parameters(cls: type) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(cls).parameters.values()]


def test_both_plugins_have_one_signature_precision_device_scaler_then_keywords() -> None:
    expected = [
        ("precision", "POSITIONAL_OR_KEYWORD"),
        ("device", "POSITIONAL_OR_KEYWORD"),
        ("scaler", "POSITIONAL_OR_KEYWORD"),
        ("options", "VAR_KEYWORD"),
    ]
    assert _parameters(AMPPrecision) == _parameters(FabricAMPPrecision) == expected
    assert sorted(RunOptions.__annotations__) == sorted(DEFAULTS)  # the keywords, defined once


@pytest.mark.parametrize("plugin", PLUGINS)
def test_every_keyword_is_taken_by_both_plugins(plugin: type) -> None:
    """Each option, passed with its default, builds either plugin (Fabric: what Fabric can do)."""
    for name, default in DEFAULTS.items():
        value = False if plugin is FabricAMPPrecision and default is True and name != "guard" else default
        built = plugin("bf16-mixed", device="cpu", **{name: value})
        assert built.precision == "bf16-mixed", name


@pytest.mark.parametrize("name", ["clip_fused", "fp32_grad_accumulation"])
def test_fabric_refuses_what_only_the_trainer_can_do_rather_than_ignore_it(name: str) -> None:
    with pytest.raises(ValueError, match=rf"AMPPrecision\({name}=True\).*Trainer's.*HINT: drop {name}=True"):
        FabricAMPPrecision("bf16-true", device="cpu", **{name: True})
    assert getattr(FabricAMPPrecision("bf16-true", device="cpu", **{name: False}), name) is False


@pytest.mark.parametrize("plugin", PLUGINS)
def test_an_unknown_keyword_names_the_one_meant(plugin: type) -> None:
    with pytest.raises(TypeError, match=r"master_weight=True.*HINT: did you mean master_weights="):
        plugin("bf16-mixed", device="cpu", master_weight=True)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_options_after_scaler_are_keyword_only(plugin: type) -> None:
    """A fourth positional argument meant different things in the two plugins; now it is refused."""
    with pytest.raises(TypeError):
        plugin("16-mixed", "cpu", None, "torch")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_a_bad_option_is_refused_the_same_way_by_both(plugin: type) -> None:
    with pytest.raises(ValueError, match=r"AMPPrecision\(precision='bf16-true', master_weights=True\).*HINT"):
        plugin("bf16-true", device="cpu", master_weights=True)
    with pytest.raises(TypeError, match=r"fp32_grad_accumulation.*HINT"):
        plugin("bf16-true", device="cpu", fp32_grad_accumulation="yes")


def test_fabric_runs_the_fp32_functions_in_its_forward_context() -> None:
    """``fp32_functions`` was the Trainer's only; Fabric's forward passes now honour it too."""
    plugin = FabricAMPPrecision("bf16-mixed", device="cpu", fp32_functions=[torch.sigmoid])
    x = torch.randn(4, 4)
    with plugin.forward_context():
        assert torch.mm(x, x).dtype == torch.bfloat16  # autocast is on
        assert torch.sigmoid(x.bfloat16()).dtype == torch.float32  # the function runs in fp32
    assert plugin.fp32_functions == (torch.sigmoid,)


def test_the_run_builds_the_guard_once_and_both_plugins_show_it() -> None:
    for plugin in (AMPPrecision("bf16-true", device="cpu"), FabricAMPPrecision("bf16-true", device="cpu")):
        guard = plugin.guard
        assert guard is not None and guard.get_scale() == 1.0 and plugin.scaler is None
        assert plugin.driver is not None and plugin.driver.scaler is guard


def test_an_assigned_scaler_reaches_the_steps_in_both_plugins() -> None:
    for plugin in (AMPPrecision("16-mixed", device="cpu"), FabricAMPPrecision("16-mixed", device="cpu")):
        new = LossScaler("cpu", init_scale=8.0)
        plugin.scaler = new
        assert plugin.scaler is new and plugin.guard is new and plugin.driver.scaler is new
        with pytest.raises(ValueError, match="HINT"):
            plugin.scaler = None
        assert plugin.scaler is new  # nothing changed


def test_the_run_is_plain_torch_and_resolves_auto_when_asked() -> None:
    said: list[tuple[str, bool]] = []
    run = AMPRun("auto", say=lambda message, warn: said.append((message, warn)))
    assert run.precision == "auto" and run.guard is None  # not resolved yet
    assert run.resolve("cpu") == ("cpu", torch.bfloat16)
    assert run.precision == "bf16-mixed" and run.guard is not None
    assert said[0] == ("AMPPrecision('auto') chose bf16-mixed: bf16: CPU autocast supports bf16", False)


def test_the_run_converts_a_model_for_master_weights() -> None:
    run = AMPRun("bf16-mixed", "cpu", master_weights=True)
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert run.convert(model, "cpu") is None  # no fp8 report without fp8
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert run.masters is not None and run.masters.master_of(model[0].weight) is not None


def test_the_runs_state_round_trips_and_a_bad_one_changes_nothing() -> None:
    """The core owns the state an adapter saves (Fabric's plugin hands it over as its state_dict)."""
    run = AMPRun("bf16-true", "cpu", rounding="stochastic")
    model = nn.Linear(2, 2)
    run.convert(model, "cpu")
    run.attach(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    state = run.state_dict()
    assert sorted(state) == ["guard", "rounding"]
    fresh = AMPRun("bf16-true", "cpu", rounding="stochastic")
    fresh.convert(nn.Linear(2, 2), "cpu")
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=r"not a loss scaler's state.*HINT"):
        fresh.load_state_dict({**state, "guard": {"scale": "not a number"}})
    assert fresh.state_dict().keys() == before.keys() and str(fresh.state_dict()) == str(before)
    fresh.load_state_dict(state)
    assert str(fresh.state_dict()) == str(state)


def test_a_scale_in_a_run_without_a_scaler_is_said_and_ignored() -> None:
    said: list[str] = []
    run = AMPRun("bf16-mixed", "cpu", say=lambda message, warn: said.append(message))
    run.load_state_dict(LossScaler("cpu", init_scale=8.0).state_dict())
    assert said == ["The checkpoint holds a loss-scaler state, but this bf16 run has no scaler: ignored."]
    assert run.guard is not None and run.guard.get_scale() == 1.0


def test_the_runs_metrics_count_a_skip_as_both_plugins_report_it() -> None:
    """The core builds the amp/* values; Fabric's ``metrics()`` hands them over."""
    run = AMPRun("16-mixed", "cpu", scaler=LossScaler("cpu", init_scale=4.0))
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    guard = run.require_driver().scaler
    assert guard is not None
    for value in (float("inf"), 1.0):
        guard.scale((param * value).sum()).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    metrics = run.metrics(3.0)
    assert metrics == {"amp/scale": 2.0, "amp/skipped_steps": 1.0, "amp/skip_rate": 0.5, "amp/grad_norm": 3.0}
    assert FabricAMPPrecision("16-mixed", device="cpu").metrics(grad_norm=3.0)["amp/grad_norm"] == 3.0


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1], TypeError, r"AMPPrecision.load_state_dict\(state=list\).*Allowed: a dict.*HINT"),
        ("x", TypeError, r"state=str.*HINT"),
        ({"guard": 3}, ValueError, r"'guard' of int 3.*HINT"),
    ],
)
def test_a_state_of_the_wrong_shape_is_refused_with_a_hint(state: object, error: type, match: str) -> None:
    run = AMPRun("bf16-mixed", "cpu")
    before = run.state_dict()
    with pytest.raises(error, match=match):
        run.load_state_dict(state)  # type: ignore[arg-type]
    assert run.state_dict() == before


def test_a_refusal_after_the_cast_says_the_model_is_half_now() -> None:
    run = AMPRun("16-true", "cpu")
    model = nn.Linear(2, 2)
    run.convert(model, "cpu")  # what a fit does first, before configure_optimizers
    with pytest.raises(ValueError, match="eps") as info:
        run.attach(model, [torch.optim.AdamW(model.parameters(), eps=1e-8)])
    assert "HINT" in str(info.value)
    assert str(info.value).endswith("Rebuild the model, or load its fp32 weights, before trying again.")
    assert "already cast to float16" in str(info.value)


def test_a_refusal_before_any_cast_carries_no_note() -> None:
    run = AMPRun("16-mixed", "cpu")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="LBFGS") as info:
        run.attach(model, [torch.optim.LBFGS(model.parameters())])
    assert "already cast" not in str(info.value)


def test_the_cpu_emulation_note_is_said_once_per_half_type(monkeypatch: pytest.MonkeyPatch) -> None:
    import amp_plugin.precision

    monkeypatch.setattr(amp_plugin.precision, "native_on_cpu", lambda dtype: False)
    said: list[str] = []

    def say(message: str, warn: bool) -> None:
        said.append(message)

    for precision in ("16-mixed", "16-true", "16-mixed", "bf16-mixed", "bf16-true"):
        AMPRun(precision, "cpu", say=say)
    notes = [m for m in said if "CPU autocast emulates" in m]
    assert len(notes) == 2, notes
    assert "no fp16 instructions" in notes[0] and "no bf16 instructions" in notes[1]


@pytest.mark.parametrize("plugin", PLUGINS)
def test_master_weights_under_32_true_is_refused_with_a_fix_that_works(plugin: type) -> None:
    with pytest.raises(ValueError, match=r"fp32 already.*HINT: drop master_weights") as info:
        plugin("32-true", device="cpu", master_weights=True)
    assert "32-mixed" not in str(info.value)  # no such precision
