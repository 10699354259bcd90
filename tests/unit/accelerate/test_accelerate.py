"""amp_plugin.accelerate: LossScaler in place of Accelerate's GradScaler, in Accelerate's own loop."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import LossScaler

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

from amp_plugin.accelerate import use_loss_scaler  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    AcceleratorState._reset_state(True)  # Accelerate keeps one process-wide state; each test makes its own
    yield
    AcceleratorState._reset_state(True)


def _prepared(scaler: LossScaler | None = None, lr: float = 0.1, **kwargs: Any) -> tuple[Any, ...]:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", **kwargs)
    installed = use_loss_scaler(accelerator, scaler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    return accelerator, installed, model, opt


def _backward(accelerator: Any, model: nn.Module, poison: bool = False) -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    out = model(x)
    loss = (out.float() - x.sum(1, keepdim=True)).pow(2).mean()
    accelerator.backward(loss)
    if poison:
        model[2].weight.grad[0, 3] = math.inf
    return out


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_an_overflowing_step_is_skipped_and_the_weights_stay() -> None:
    accelerator, scaler, model, opt = _prepared(LossScaler(init_scale=1024.0, hysteresis=2))
    assert accelerator.scaler is scaler and opt.scaler is scaler
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    out = _backward(accelerator, model, poison=True)
    # Accelerate autocasts the forward in fp16 (on the CPU too) and hands back fp32 outputs.
    assert dtypes == [torch.float16] and out.dtype == torch.float32
    before = _weights(model)
    opt.step()
    assert accelerator.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert (scaler.get_scale(), scaler.skipped_steps) == (1024.0, 1)  # hysteresis=2: no back-off yet
    opt.zero_grad()
    _backward(accelerator, model)
    opt.step()
    assert not accelerator.optimizer_step_was_skipped and scaler.total_steps == 2
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_clip_grad_norm_clips_and_returns_the_unscaled_norm() -> None:
    accelerator, _, model, opt = _prepared(LossScaler(init_scale=2.0**12), lr=1.0)
    _backward(accelerator, model)
    scaled = [p.grad.double().clone() for p in model.parameters()]
    expected = torch.cat([g.flatten() for g in scaled]).norm().item() / 2.0**12
    before = _weights(model)
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.25)
    assert norm.item() == pytest.approx(expected, rel=1e-5) and expected > 0.25
    opt.step()  # the gradients are unscaled already: the step must not divide them again
    # lr=1: the step is the applied gradient
    step = [(b - a).double() for a, b in zip(_weights(model), before, strict=True)]
    applied = torch.cat([s.flatten() for s in step]).norm().item()
    assert applied == pytest.approx(0.25, rel=1e-4)
    for s, g in zip(step, scaled, strict=True):
        torch.testing.assert_close(s, g / 2.0**12 * (0.25 / expected), rtol=1e-3, atol=1e-7)


def test_gradient_accumulation_updates_the_scaler_once_per_synchronised_step() -> None:
    accelerator, scaler, model, opt = _prepared(LossScaler(init_scale=256.0), gradient_accumulation_steps=2)
    for batch in range(6):
        with accelerator.accumulate(model):
            _backward(accelerator, model, poison=batch == 2)  # poisons the first half of the second step
            opt.step()
            opt.zero_grad()
    assert (scaler.total_steps, scaler.skipped_steps, scaler.get_scale()) == (3, 1, 128.0)


def test_save_state_and_load_state_carry_the_loss_scaler(tmp_path: Path) -> None:
    accelerator, scaler, model, opt = _prepared(LossScaler(init_scale=256.0, growth_interval=3))
    for poison in (False, True, False, False, False):
        _backward(accelerator, model, poison)
        opt.step()
        opt.zero_grad()
    saved = scaler.state_dict()
    assert (saved["scale"], saved["skipped_steps"], saved["total_steps"]) == (256.0, 1, 5)
    accelerator.save_state(str(tmp_path / "ckpt"))

    AcceleratorState._reset_state(True)
    fresh, new_scaler, _, _ = _prepared(LossScaler(init_scale=2.0**16))
    fresh.load_state(str(tmp_path / "ckpt"))
    assert new_scaler.state_dict() == saved and fresh.scaler is new_scaler


def test_without_a_scaler_it_takes_the_grad_scalers_settings() -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)  # as on a GPU
    scaler = use_loss_scaler(accelerator)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (512.0, 7)
    assert use_loss_scaler(accelerator) is scaler  # a second call keeps the installed one


def test_the_default_on_the_cpu_is_grad_scalers_default() -> None:
    scaler = use_loss_scaler(accelerate.Accelerator(cpu=True, mixed_precision="fp16"))
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (2.0**16, 2000)


def test_on_the_cpu_grad_scaler_kwargs_still_apply() -> None:
    from accelerate.utils import GradScalerKwargs

    kwargs = GradScalerKwargs(init_scale=1024.0, growth_interval=10)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[kwargs])
    assert accelerator.scaler is None  # Accelerate builds no GradScaler on the CPU
    scaler = use_loss_scaler(accelerator)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 10)


@pytest.mark.parametrize(
    ("make", "scaler", "error", "match"),
    [
        (lambda: accelerate.Accelerator(cpu=True, mixed_precision="bf16"), None, ValueError,
         r"mixed_precision='bf16'.*HINT: bf16 needs no loss scaler"),
        (lambda: accelerate.Accelerator(cpu=True), None, ValueError, r"mixed_precision='no'.*HINT"),
        (lambda: accelerate.Accelerator(cpu=True, mixed_precision="fp16"), "LossScaler", TypeError,
         r"scaler=str.*a LossScaler.*HINT"),
        (lambda: accelerate.Accelerator(cpu=True, mixed_precision="fp16"), LossScaler(enabled=False),
         ValueError, r"a disabled LossScaler.*HINT"),
        (lambda: object(), None, TypeError, r"accelerator=object.*an accelerate.Accelerator.*HINT"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_a_hint(make: Any, scaler: Any, error: type[Exception], match: str) -> None:
    accelerator = make()
    before = getattr(accelerator, "scaler", None), getattr(accelerator, "native_amp", None)
    with pytest.raises(error, match=match):
        use_loss_scaler(accelerator, scaler)
    assert (getattr(accelerator, "scaler", None), getattr(accelerator, "native_amp", None)) == before


def test_after_prepare_it_refuses_and_changes_nothing() -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    model = accelerator.prepare(nn.Linear(2, 1))
    del model
    with pytest.raises(RuntimeError, match=r"after Accelerator.prepare.*HINT: call use_loss_scaler"):
        use_loss_scaler(accelerator)
    assert accelerator.scaler is None and accelerator.native_amp is False


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_importing_amp_plugin_does_not_import_accelerate() -> None:
    code = "import sys, amp_plugin, amp_plugin.accelerate; print('accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.cuda
def test_on_a_gpu_it_replaces_accelerates_grad_scaler() -> None:
    kwargs = accelerate.utils.GradScalerKwargs(init_scale=128.0, growth_interval=5)
    accelerator = accelerate.Accelerator(mixed_precision="fp16", kwargs_handlers=[kwargs])
    assert isinstance(accelerator.scaler, torch.amp.GradScaler)
    scaler = use_loss_scaler(accelerator)
    assert accelerator.scaler is scaler and (scaler.get_scale(), scaler.get_growth_interval()) == (128.0, 5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(16, 4, device=accelerator.device)
    accelerator.backward(model(x).float().pow(2).mean())
    model[2].weight.grad[0, 3] = math.inf
    before = _weights(model)
    opt.step()
    assert accelerator.optimizer_step_was_skipped and scaler.get_scale() == 64.0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
