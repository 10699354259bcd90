"""``precision.scaler = other`` after construction is honoured by every plugin (or refused with a HINT).

Lightning's own plugin tests, and users (Lightning issue 19803), assign a scaler this way; a step
driver holding the old one would ignore it silently. Also what Lightning's tests check of the
plugins' surface: Fabric's ``forward_context()`` is a ``torch.autocast``, and
``AMPFSDPPrecision`` words its errors as ``FSDPPrecision`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from amp_plugin import AMPPrecision, LossScaler
from amp_plugin.lightning import fabric as fabric_plugin
from amp_plugin.lightning._fsdp import AMPFSDPPrecision

pytestmark = pytest.mark.filterwarnings("ignore:.*emulates.*")


def _fit(plugin: Any, steps: int = 3) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())


@pytest.mark.parametrize("device", ["cpu", None])  # resolved at construction, or at fit start
def test_trainer_plugin_steps_with_the_scaler_assigned_after_construction(device: str | None) -> None:
    plugin = AMPPrecision("16-mixed", device=device)
    first = LossScaler("cpu", init_scale=8.0)
    plugin.scaler = first
    _fit(plugin)
    assert plugin.scaler is first and plugin.guard is first
    assert first.total_steps == 3
    second = LossScaler("cpu", init_scale=4.0)
    plugin.scaler = second  # between two fits
    _fit(plugin, steps=2)
    assert plugin.guard is second and (first.total_steps, second.total_steps) == (3, 2)


def test_fabric_plugin_steps_with_the_scaler_assigned_after_construction() -> None:
    plugin = fabric_plugin.AMPPrecision("16-mixed", device="cpu")
    first = plugin.scaler
    assigned = LossScaler("cpu", init_scale=8.0)
    plugin.scaler = assigned
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Linear(4, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        fabric.backward(model(torch.randn(8, 4)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert plugin.guard is assigned and assigned.total_steps == 2
    assert first is not None and first.total_steps == 0


def test_a_torch_grad_scaler_assigned_is_converted_as_in_the_constructor() -> None:
    for plugin in (
        AMPPrecision("16-mixed", device="cpu"),
        fabric_plugin.AMPPrecision("16-mixed", device="cpu"),
    ):
        plugin.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        assert isinstance(plugin.scaler, LossScaler) and plugin.guard is plugin.scaler
        assert plugin.scaler.get_scale() == 4.0


def test_fsdp_plugin_takes_the_scaler_assigned_after_construction() -> None:
    plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
    assigned = LossScaler("cpu", init_scale=8.0)
    plugin.scaler = assigned
    assert plugin.scaler is assigned and plugin.guard is assigned
    assert plugin.state_dict()["scale"] == 8.0


PLUGINS = {
    "trainer": lambda precision: AMPPrecision(precision, device="cpu"),
    "fabric": lambda precision: fabric_plugin.AMPPrecision(precision, device="cpu"),
    "fsdp": lambda precision: AMPFSDPPrecision(
        precision, scaler=LossScaler("cpu") if precision == "16-mixed" else None
    ),
}


@pytest.mark.parametrize("kind", list(PLUGINS))
@pytest.mark.parametrize(
    ("precision", "value", "error", "match"),
    [
        ("16-mixed", "not a scaler", TypeError, r"scaler.*str.*HINT"),
        ("bf16-mixed", "loss scaler", ValueError, r"`precision='bf16-mixed'` does not use a scaler.*HINT"),
        ("16-mixed", None, ValueError, r"fp16.*needs a loss scaler.*HINT"),
    ],
)
def test_an_assignment_that_cannot_work_is_refused_and_changes_nothing(
    kind: str, precision: str, value: Any, error: type[Exception], match: str
) -> None:
    plugin = PLUGINS[kind](precision)
    before, guard = plugin.scaler, plugin.guard
    with pytest.raises(error, match=match):
        plugin.scaler = LossScaler("cpu") if value == "loss scaler" else value
    assert plugin.scaler is before and plugin.guard is guard


def test_bf16_plugins_take_none() -> None:
    for plugin in (
        AMPPrecision("bf16-mixed", device="cpu"),
        fabric_plugin.AMPPrecision("bf16-mixed", device="cpu"),
    ):
        guard = plugin.guard
        plugin.scaler = None
        assert plugin.scaler is None and plugin.guard is guard


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_fabric_forward_context_is_a_torch_autocast(precision: str) -> None:
    """Lightning's Fabric tests check ``isinstance(precision.forward_context(), torch.autocast)``."""
    plugin = fabric_plugin.AMPPrecision(precision, device="cpu")  # type: ignore[arg-type]
    context = plugin.forward_context()
    assert isinstance(context, torch.autocast)
    with context:
        assert torch.is_autocast_enabled("cpu") == (precision != "32-true")
        if precision != "32-true":
            assert torch.get_autocast_dtype("cpu") == plugin.dtype


def test_fabric_forward_context_under_a_true_precision_also_switches_the_default_dtype() -> None:
    with fabric_plugin.AMPPrecision("bf16-true", device="cpu").forward_context():
        assert torch.get_default_dtype() == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"precision": "64-true"},
            "`precision='64-true'` is not supported in FSDP. `precision` must be one of",
        ),
        (
            {"precision": "bf16-mixed", "scaler": LossScaler("cpu")},
            "`precision='bf16-mixed'` does not use a scaler",
        ),
    ],
)
def test_fsdp_errors_carry_lightnings_words(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=rf"{words}.*HINT"):
        AMPFSDPPrecision(**kwargs)


@pytest.mark.filterwarnings("ignore:.*CUDA is not available")  # FSDPPrecision's own default scaler
def test_lightnings_fsdp_precision_resumes_the_scale_of_an_amp_fsdp_checkpoint() -> None:
    """AMPFSDPPrecision to FSDPPrecision: the scale carries over (saved and loaded as Lightning does)."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    ours = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu", init_scale=512.0, growth_interval=7))
    checkpoint: dict[str, Any] = {}
    if state := ours.state_dict():  # what Lightning's checkpoint connector writes
        checkpoint[type(ours).__qualname__] = state
    ours.on_save_checkpoint(checkpoint)
    theirs = FSDPPrecision("16-mixed")
    theirs.scaler = ShardedGradScaler("cpu")  # its own default is a CUDA one
    theirs.on_load_checkpoint(checkpoint)  # what the connector reads back
    if type(theirs).__qualname__ in checkpoint:
        theirs.load_state_dict(checkpoint[type(theirs).__qualname__])
    assert (theirs.scaler.get_scale(), theirs.scaler.get_growth_interval()) == (512.0, 7)
