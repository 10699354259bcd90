"""``Trainer.fit`` and Fabric with ``AMPPrecision("bf16-mixed", fp8=...)`` on CPU (torchao's fp8 matmuls).

The reference of every fp8 run is the same model and batches under ``"bf16-mixed"``; a skipped step
is checked against the state before it, bit for bit; a checkpoint against a model that never saw fp8.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # its CUDA extensions cannot load on CPU

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.data import DataLoader

from amp_plugin import AMPPrecision, LossScaleMonitor, _imports
from amp_plugin.fp8 import Float8, float8_layer_names
from tests._fp8_models import TinyLM, batches, lm_loss

# Slow (subprocesses or multi-step fits): the one-thread pass of the test command skips it.
pytestmark = [
    pytest.mark.skipif(
        _imports.torchao_error() is not None, reason=f"needs torchao 0.18 ({_imports.torchao_error()})"
    ),
    pytest.mark.slow,
]
SMALL = Float8(min_features=64)
BAD = 3  # the batch whose gradients go NaN


class _LM(LightningModule):
    def __init__(self, poison: bool = False, compile_with: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM()
        self.poison, self.compile_with = poison, compile_with
        self.losses: list[float] = []
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None

    def configure_model(self) -> None:
        if self.compile_with is not None:
            self.forward_net = torch.compile(self.model, fullgraph=True, backend=self.compile_with)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        net = getattr(self, "forward_net", self.model)
        loss = lm_loss(net, *batch)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.poison and self.trainer.fit_loop.batch_idx == BAD:
            grad = self.model.blocks[0].fc1.weight.grad
            assert grad is not None
            grad[0, 0] = float("nan")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == BAD:
            self.before = _snapshot(self)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == BAD:
            self.after = _snapshot(self)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _snapshot(module: LightningModule) -> dict[str, Any]:
    opt = module.trainer.optimizers[0]
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "opt": copy.deepcopy(opt.state_dict()["state"]),
    }


def _fit(
    module: LightningModule,
    plugin: AMPPrecision,
    steps: int = 30,
    ckpt_path: Path | None = None,
    **trainer: Any,
) -> Trainer:
    data = batches(steps)
    settings: dict[str, Any] = {"logger": False, "max_epochs": 1, **trainer}
    run = Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **settings,
    )  # fmt: skip
    run.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return run


def test_fp8_fit_converts_reports_and_trains_like_bf16(caplog: pytest.LogCaptureFixture) -> None:
    """24 steps of TinyLM: the mean loss of the last 10 is within 5% of bf16's (measured on CPU: bf16 0.6150
    from 4.51 at the start, fp8 tensorwise 0.6170, +0.33%)."""
    reference = _LM()
    _fit(reference, AMPPrecision("bf16-mixed"), steps=24)
    module, plugin = _LM(), AMPPrecision("bf16-mixed", fp8=SMALL)
    with caplog.at_level(logging.INFO):
        _fit(module, plugin, steps=24)
    assert plugin.fp8_report is not None
    assert float8_layer_names(module) == plugin.fp8_report.converted_names
    assert len(plugin.fp8_report.converted) == 7
    assert "fp8 (tensorwise): 7 of 9 Linear layers" in caplog.text
    ref, got = sum(reference.losses[-10:]) / 10, sum(module.losses[-10:]) / 10
    assert ref < 0.5 * reference.losses[0]
    assert abs(got - ref) <= 0.05 * ref, (got, ref)
    assert module.losses != reference.losses


def test_nan_in_an_fp8_fit_is_skipped_with_state_bit_identical() -> None:
    module, plugin = _LM(poison=True), AMPPrecision("bf16-mixed", fp8=SMALL)
    _fit(module, plugin, steps=6)
    assert module.before is not None and module.after is not None
    assert all(
        torch.equal(a, b) for a, b in zip(module.before["params"], module.after["params"], strict=True)
    )
    opt_before, opt_after = module.before["opt"], module.after["opt"]
    assert all(torch.equal(opt_before[i][k], opt_after[i][k]) for i in opt_before for k in opt_before[i])
    assert plugin.guard is not None and plugin.guard.skipped_steps == 1


def test_fp8_checkpoint_loads_into_a_model_without_fp8(tmp_path: Path) -> None:
    straight = _LM()
    run = _fit(straight, AMPPrecision("bf16-mixed", fp8=SMALL), steps=8)
    path = tmp_path / "fp8.ckpt"
    run.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all(type(t) is torch.Tensor for t in state.values())
    plain = _LM()
    plain.load_state_dict(state)  # an ordinary model, no torchao
    assert float8_layer_names(plain.model) == ()


def test_fp8_resume_is_bit_exact(tmp_path: Path) -> None:
    """Two epochs of 4 batches straight == one epoch, a checkpoint, a resumed second epoch (all fp8)."""
    straight = _LM()
    _fit(straight, AMPPrecision("bf16-mixed", fp8=SMALL), steps=4, max_epochs=2)
    first = _fit(_LM(), AMPPrecision("bf16-mixed", fp8=SMALL), steps=4, max_epochs=1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = _LM()
    _fit(
        resumed,
        AMPPrecision("bf16-mixed", fp8=SMALL),
        steps=4,
        max_epochs=2,
        ckpt_path=tmp_path / "epoch1.ckpt",
    )
    want, got = straight.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_fp8_fit_compiles_into_one_graph() -> None:
    compiler = CompileCounterWithBackend("aot_eager")
    module = _LM(compile_with=compiler)
    _fit(module, AMPPrecision("bf16-mixed", fp8=SMALL), steps=4)  # fullgraph=True: a break would raise
    assert compiler.frame_count == 1
    assert len(float8_layer_names(module.model)) == 7


class _ListLogger(CSVLogger):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((int(step or 0), dict(metrics)))
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("fp8", [SMALL, None])
def test_monitor_logs_the_fp8_layers_once(tmp_path: Path, fp8: Float8 | None) -> None:
    logger = _ListLogger(tmp_path)
    _fit(
        _LM(),
        AMPPrecision("bf16-mixed", fp8=fp8),
        steps=4,
        callbacks=[LossScaleMonitor()],
        logger=logger,
        log_every_n_steps=2,
    )
    calls = [(step, m) for step, m in logger.calls if any(k.startswith("amp/fp8") for k in m)]
    if fp8 is None:
        assert calls == []
        return
    assert calls == [(0, {"amp/fp8_layers": 7.0, "amp/fp8_param_share": 86_976 / 105_600})]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"precision": "16-mixed", "fp8": "tensorwise"},
            ValueError,
            r"fp8='tensorwise'.*HINT: use precision=",
        ),
        ({"precision": "auto", "fp8": "rowwise"}, ValueError, r"precision='auto', fp8='rowwise'"),
        ({"precision": "bf16-mixed", "fp8": "delayed"}, ValueError, r"fp8='delayed'.*'tensorwise'"),
        ({"precision": "bf16-mixed", "fp8": 8}, TypeError, r"fp8=8"),
        (
            {"precision": "bf16-mixed", "fp8": "tensorwise", "master_weights": True},
            ValueError,
            r"master_weights=True.*HINT: drop master_weights",
        ),
    ],
)
def test_bad_fp8_requests_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AMPPrecision(**kwargs)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true", "32-true"])
def test_fabric_refuses_fp8_outside_bf16_mixed(precision: str) -> None:
    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    with pytest.raises(
        ValueError, match=rf"^AMPPrecision\(precision='{precision}', fp8='rowwise'\)"
    ):
        FabricAMPPrecision(precision, device="cpu", fp8="rowwise")


def test_fp8_without_torchao_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now fails
    with pytest.raises(
        ImportError, match=r"AMPPrecision\(fp8='tensorwise'\) needs torchao.*HINT: pip install"
    ):
        AMPPrecision("bf16-mixed", fp8="tensorwise")


def test_fabric_fp8_converts_at_setup_and_skips_a_nan() -> None:
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    plugin = FabricAMPPrecision("bf16-mixed", device="cpu", fp8=SMALL)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    assert plugin.fp8_report is not None and len(plugin.fp8_report.converted) == 7
    assert len(float8_layer_names(model)) == 7
    for step, (tokens, targets) in enumerate(batches(3)):
        with fabric.autocast():
            loss = lm_loss(model, tokens, targets)
        fabric.backward(loss * (float("nan") if step == 1 else 1.0))
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        if step == 1:
            assert plugin.last_step_skipped
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert plugin.guard is not None and plugin.guard.skipped_steps == 1


class _Fp32Block(torch.nn.Module):
    """A block the user asks to run in fp32 (``fp32_modules``): its Linear must not run in fp8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _with_fp32_block() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), _Fp32Block(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    )


def test_fp32_modules_stay_out_of_fp8_in_the_trainer_plugin() -> None:
    model = _with_fp32_block()
    plugin = AMPPrecision("bf16-mixed", device="cpu", fp8=SMALL, fp32_modules=(_Fp32Block,))
    plugin.convert_module(model)
    assert plugin.fp8_report is not None and plugin.fp8_report.converted_names == ("2",)
    assert {c.name: c.reason for c in plugin.fp8_report.left_out}["1.fc"] == "in fp32_modules (_Fp32Block)"
    assert float8_layer_names(model) == ("2",)


def test_fp32_modules_stay_out_of_fp8_and_in_fp32_under_fabric() -> None:
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    plugin = FabricAMPPrecision("bf16-mixed", device="cpu", fp8=SMALL, fp32_modules=(_Fp32Block,))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _with_fp32_block()
    model = fabric.setup(net)
    assert float8_layer_names(net) == ("2",)
    seen: list[torch.dtype] = []
    net[1].fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    assert model(torch.randn(4, 64)).dtype == torch.float32
    assert seen == [torch.float32]  # the block ran in fp32 with autocast off


def test_fabric_fp8_all_gather_steps_the_weights_the_model_uses() -> None:
    # torchao's fp8 all-gather wraps each converted weight in a new Parameter; an optimizer built
    # before fabric.setup (Fabric's usual order) held the old ones and never moved those layers.
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    plugin = FabricAMPPrecision("bf16-mixed", device="cpu", fp8=Float8(min_features=64, all_gather=True))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = TinyLM()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert len(float8_layer_names(net)) == 7
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    tokens, targets = batches(1)[0]
    fabric.backward(lm_loss(model, tokens, targets))
    opt.step()
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    assert all(id(p) in stepped for p in net.parameters())
    fc1 = net.blocks[0].fc1.weight
    assert not torch.equal(before["blocks.0.fc1.weight"], fc1.detach())


def test_a_failed_fabric_fp8_conversion_leaves_no_fp32_hooks_behind() -> None:
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    def broken(module: torch.nn.Module, name: str) -> bool:
        raise AttributeError("a bug in the user's filter")

    plugin = FabricAMPPrecision(
        "bf16-mixed", device="cpu", fp8=Float8(filter=broken), fp32_modules=(torch.nn.LayerNorm,)
    )
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = TinyLM()
    with pytest.raises(AttributeError, match="a bug in the user's filter"):
        fabric.setup(model)
    assert float8_layer_names(model) == ()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_fabric_fp8_all_gather_repoints_the_first_models_optimizer_after_a_second_setup() -> None:
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision

    plugin = FabricAMPPrecision("bf16-mixed", device="cpu", fp8=Float8(min_features=64, all_gather=True))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    nets = [TinyLM(), TinyLM()]
    (first, first_opt), _ = (fabric.setup(n, torch.optim.SGD(n.parameters(), lr=0.1)) for n in nets)
    tokens, targets = batches(1)[0]
    fabric.backward(lm_loss(first, tokens, targets))
    first_opt.step()
    stepped = {id(p) for group in first_opt.param_groups for p in group["params"]}
    assert all(id(p) in stepped for p in nets[0].parameters())
