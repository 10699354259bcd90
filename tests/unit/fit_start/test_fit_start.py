"""The fit-start checks every adapter runs: what the optimizers step, against the run's precision."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from amp_plugin._fit_start import check_fit_start, module_device
from amp_plugin._run import AMPRun


def test_the_module_device_comes_from_device_then_parameters() -> None:
    assert module_device(BoringModel()) == "cpu"
    assert module_device(nn.Linear(2, 1).to("meta")) == "meta"
    assert module_device(nn.ReLU()) == "cpu"


def test_fit_start_refuses_lbfgs_only_under_loss_scaling() -> None:
    model = nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    check_fit_start(model, [lbfgs], "cpu", torch.bfloat16, grad_scaling=False)
    with pytest.raises(ValueError, match=r"cannot drive LBFGS.*HINT: use precision='bf16-mixed'"):
        check_fit_start(model, [lbfgs], "cpu", torch.float16, grad_scaling=True)


def _half_model(frozen_at_cast: bool = False) -> nn.Module:
    from amp_plugin.master_weights import cast_model

    model = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    model[0].weight.requires_grad_(not frozen_at_cast)
    cast_model(model, torch.float16)
    model[0].weight.requires_grad_(True)
    return model


def test_fit_start_with_masters_accepts_an_eps_fp16_would_round_to_zero() -> None:
    model = _half_model()  # the optimizer steps the fp32 masters
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    check_fit_start(model, [opt], "cpu", torch.float16, grad_scaling=True, weights="master")


@pytest.mark.parametrize("case", ["frozen at the cast", "never cast"])
def test_fit_start_with_masters_refuses_a_half_parameter_stepped_without_one(case: str) -> None:
    model = _half_model(frozen_at_cast=True) if case == "frozen at the cast" else nn.Linear(2, 1).half()
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    with pytest.raises(
        ValueError, match=r"optimizer 0 \(AdamW\) steps \d float16 param.*weight.*no fp32 master.*HINT: set"
    ):
        check_fit_start(model, [opt], "cpu", torch.float16, grad_scaling=True, weights="master")


def test_fit_start_with_half_weights_refuses_an_eps_fp16_rounds_to_zero() -> None:
    model = nn.Linear(2, 1).half()
    opts = [torch.optim.AdamW(model.parameters())]
    with pytest.raises(ValueError, match=r"AdamW\(eps=1e-08\).*rounds to 0.*HINT"):
        check_fit_start(model, opts, "cpu", torch.float16, True, "half")


def test_fit_start_with_half_weights_refuses_a_subnormal_eps_for_what_it_is() -> None:
    model = nn.Linear(2, 1).half()
    opts = [torch.optim.AdamW(model.parameters(), eps=6e-5)]  # fp16 keeps it, as a subnormal
    with pytest.raises(ValueError, match=r"AdamW\(eps=6e-05\).*subnormal \(stored as 6e-05\).*HINT") as info:
        check_fit_start(model, opts, "cpu", torch.float16, True, "half")
    assert "rounds to 0" not in str(info.value)


@pytest.mark.parametrize("weights", ["master", "half"])
def test_lbfgs_with_half_weights_is_refused_at_fit_start(weights: str) -> None:
    """LBFGS evaluates its closure several times per step: master weights and "-true" rounding
    cannot follow that, so it is refused before anything changes (it failed with a raw error)."""
    model = torch.nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"LBFGS.*HINT: .*'bf16-mixed'"):
        check_fit_start(model, [lbfgs], "cpu", torch.bfloat16, False, weights)


def test_the_run_checks_at_attach_and_says_its_warnings_through_the_adapters_say() -> None:
    """One core for Trainer and Fabric: AMPRun.attach checks, and warns through the adapter's ``say``."""
    said: list[tuple[str, bool]] = []
    run = AMPRun("bf16-mixed", "cpu", say=lambda message, warn: said.append((message, warn)))
    model = nn.Sequential(nn.DataParallel(nn.Linear(2, 1)))
    run.attach(model, [torch.optim.SGD(model.parameters(), lr=1.0)])
    assert [warn for message, warn in said if "AutocastDataParallel" in message] == [True]
    lbfgs = torch.optim.LBFGS(model.parameters())
    run.attach(model, [lbfgs])  # bf16: LBFGS steps with its closure, unguarded, and is said to
    assert any("not checked for inf/NaN" in message for message, _ in said)
    with pytest.raises(ValueError, match=r"cannot drive LBFGS.*HINT"):
        AMPRun("16-mixed", "cpu").attach(model, [lbfgs])


def test_attach_with_master_weights_refuses_before_the_masters_take_the_optimizer() -> None:
    run = AMPRun("16-mixed", "cpu", master_weights=True)
    model = nn.Linear(2, 1).half()  # cast by hand, not by the run: no fp32 masters
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"no fp32 master.*HINT"):
        run.attach(model, [opt])
    assert opt.param_groups[0]["params"][0] is model.weight  # nothing changed


def test_fit_start_accepts_remainder_masters_whose_gradient_waits_in_bf16() -> None:
    """A skipped last step leaves the masters carrying the model's bf16 gradients; a later fit of the
    same optimizer finds bf16 masters there, not half parameters without one."""
    from amp_plugin.master_weights import cast_model

    model = nn.Linear(4, 2)
    masters = cast_model(model, torch.bfloat16, master_weights="remainder")
    opt = torch.optim.AdamW(model.parameters())
    masters.attach(opt)
    model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
    masters.grads_to_master(defer=True)  # as AMPPrecision does; no step follows (skipped)
    check_fit_start(model, [opt], "cpu", torch.bfloat16, grad_scaling=False, weights="master")
