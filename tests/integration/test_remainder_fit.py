"""``master_weights="remainder"`` under the Trainer and Fabric: skips, checkpoints, interop with O2, refusals.

The numbers (bit-identity with an independent fp32-master reference) are pinned in
``tests/unit/master_weights/test_remainder_masters.py``; here the adapters are checked to drive
the same pieces.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from amp_plugin import AMPPrecision
from amp_plugin.lightning.fabric import AMPPrecision as FabricAMPPrecision
from amp_plugin.master_weights import cast_model, masters_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REMAINDER: dict[str, Any] = {"precision": "bf16-mixed", "master_weights": "remainder"}
O2_BF16: dict[str, Any] = {"precision": "bf16-mixed", "master_weights": True}


def _data(n: int = 128, seed: int = 1) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g)).tanh()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


class Regressor(L.LightningModule):
    def __init__(self, inject_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
        self.inject_at = inject_at
        self.snapshots: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def on_after_backward(self) -> None:
        if self.global_step == self.inject_at:
            self.snapshots["before"] = self._snapshot()
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if "before" in self.snapshots and "after" not in self.snapshots:
            self.snapshots["after"] = self._snapshot()

    def _snapshot(self) -> list[Tensor]:
        opt = self.trainer.optimizers[0]
        state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
        return [
            *(v.clone() for v in self.state_dict().values()),
            *(p.detach().clone() for p in self.parameters()),
            *state,
        ]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(
    kwargs: dict[str, Any], epochs: int, tmp_path: Path | None = None, ckpt: Path | None = None,
    module: Regressor | None = None, **trainer_kw: Any,
) -> tuple[Regressor, L.Trainer]:  # fmt: skip
    module = module or Regressor()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True)] if tmp_path else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[AMPPrecision(**kwargs)], max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_checkpointing=bool(tmp_path), callbacks=callbacks,
        enable_model_summary=False, **trainer_kw,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), ckpt_path=ckpt)
    return module, trainer


def test_fit_holds_bf16_weights_and_skips_a_poisoned_step_bit_identically() -> None:
    module, trainer = _fit(REMAINDER, 1, module=Regressor(inject_at=2), max_steps=4)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AMPPrecision) and plugin.masters is not None and plugin.masters.remainder
    assert module.net[0].weight.dtype == torch.bfloat16 and module.net[1].weight.dtype == torch.float32
    assert plugin.driver.scaler is not None and plugin.driver.scaler.skipped_steps == 1
    before, after = module.snapshots["before"], module.snapshots["after"]
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())


@pytest.mark.parametrize(
    ("first", "second"), [(REMAINDER, REMAINDER), (O2_BF16, REMAINDER), (REMAINDER, O2_BF16)]
)
def test_a_checkpoint_resumes_exactly_across_both_kinds_of_masters(
    first: dict[str, Any], second: dict[str, Any], tmp_path: Path
) -> None:
    saved, _ = _fit(first, 1, tmp_path)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert all(v.dtype == torch.float32 for v in checkpoint["state_dict"].values())  # fp32 masters
    for key, value in saved.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    resumed, _ = _fit(second, 1, ckpt=tmp_path / "last.ckpt")  # max_epochs=1: restores, no step
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(resumed.state_dict()[key], value), key
    if first == second:  # one more epoch from the checkpoint is the uninterrupted two-epoch run
        straight, _ = _fit(first, 2)
        continued, _ = _fit(second, 2, ckpt=tmp_path / "last.ckpt")
        for key, value in straight.state_dict().items():
            assert torch.equal(continued.state_dict()[key], value), key
        assert all(
            torch.equal(a, b) for a, b in zip(straight.parameters(), continued.parameters(), strict=True)
        )


def test_fabric_trains_with_remainder_masters_and_saves_fp32() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin = FabricAMPPrecision("bf16-mixed", master_weights="remainder", device="cpu")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for x, y in _data():
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    masters = masters_of(net)
    assert masters is not None and masters.remainder and plugin.masters is masters
    assert net[0].weight.dtype == torch.bfloat16
    state = net.state_dict()
    assert state["0.weight"].dtype == torch.float32 and not torch.equal(state["0.weight"], start["0.weight"])
    assert torch.equal(state["0.weight"], masters.values()[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "16-mixed", "master_weights": "remainder"}, r"'remainder'.*bf16-mixed.*HINT"),
        ({"precision": "auto", "master_weights": "remainder"}, r"'remainder'.*bf16-mixed.*HINT"),
        ({"precision": "bf16-true", "master_weights": "remainder"}, r"'remainder'.*bf16-mixed.*HINT"),
        ({"precision": "bf16-mixed", "master_weights": "fp32"}, r"master_weights='fp32'.*a bool.*HINT"),
        (
            {"precision": "bf16-mixed", "master_weights": "remainder", "fp8": "tensorwise"},
            r"fp8='tensorwise', master_weights='remainder'.*HINT: drop master_weights",
        ),
        (
            {"precision": "bf16-mixed", "master_weights": 1},
            r"master_weights=1.*a bool \(True or False\) or 'remainder'.*HINT",
        ),
    ],
)
@pytest.mark.parametrize("plugin", [AMPPrecision, FabricAMPPrecision])
def test_remainder_masters_are_refused_with_a_hint_where_they_cannot_be_exact(
    plugin: type, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        plugin(**kwargs, device="cpu")


def test_opt_level_o2_takes_remainder_masters_for_a_bf16_cast_only() -> None:
    plugin = AMPPrecision.from_opt_level("O2", cast_model_type=torch.bfloat16, master_weights="remainder")
    assert plugin.master_weights == "remainder" and plugin.requested == "bf16-mixed"
    with pytest.raises(ValueError, match=r"master_weights='remainder' with torch.float16.*HINT"):
        AMPPrecision.from_opt_level("O2", master_weights="remainder")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [True, "remainder"])
def test_masters_follow_a_model_moved_after_the_cast(mode: bool | str) -> None:
    """Lightning's strategies cast the model on the CPU, then move it: the masters must follow."""
    model = nn.Linear(4, 4)
    masters = cast_model(model, torch.bfloat16, master_weights=mode)  # type: ignore[arg-type]
    model.cuda()
    opt = torch.optim.AdamW(model.parameters())
    masters.attach(opt)
    model(torch.ones(2, 4, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    masters.grads_to_master()
    opt.step()
    assert all(p.device.type == "cuda" for g in opt.param_groups for p in g["params"])
    assert all(v.device.type == "cuda" for s in opt.state.values() for v in s.values() if v.dim())
    assert all(v.device.type == "cuda" for v in masters.values())


def test_gradient_accumulation_hands_the_fp32_sums_to_the_remainder_masters() -> None:
    start = {k: v.clone() for k, v in Regressor().state_dict().items()}
    module, trainer = _fit(REMAINDER, 1, accumulate_grad_batches=2)
    assert trainer.global_step == 2  # 4 batches, 2 per step
    state = module.state_dict()
    assert state["net.0.weight"].dtype == torch.float32 and not torch.equal(
        state["net.0.weight"], start["net.0.weight"]
    )
    assert all(torch.isfinite(v).all() for v in state.values())


class GradientReader(Regressor):
    """Reads the optimizer's gradients in ``on_before_optimizer_step``, as a user's hook may."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.snapshots.setdefault("grads", []).append([g.clone() for g in grads])


@pytest.mark.parametrize("clip", [{"gradient_clip_val": 1e-3}, {"gradient_clip_val": 1e-3,
                                  "gradient_clip_algorithm": "value"}])  # fmt: skip
def test_clipping_and_hooks_see_o2s_fp32_gradients_and_the_masters_follow_o2(clip: dict[str, Any]) -> None:
    """The bf16 gradients wait for the step, but a clip or a gradient hook gets the fp32 copies first.

    Clipped hard (every step), the masters stay O2's bit for bit over two epochs (no even tie
    in 8 steps here), and the hook sees fp32 gradients equal to O2's.
    """
    runs = {}
    for name, kwargs in (("o2", O2_BF16), ("remainder", REMAINDER)):
        runs[name], _ = _fit(kwargs, 2, module=GradientReader(), **clip)
    for key, value in runs["o2"].state_dict().items():
        assert torch.equal(runs["remainder"].state_dict()[key], value), key
    o2, remainder = runs["o2"].snapshots["grads"], runs["remainder"].snapshots["grads"]
    assert len(remainder) == len(o2) == 8
    for a, b in zip(o2, remainder, strict=True):
        assert [g.dtype for g in b] == [g.dtype for g in a] and all(map(torch.equal, a, b))


def test_clipping_without_a_gradient_hook_follows_o2() -> None:
    """No hook reads the gradients: they reach the step in bf16, and the clip's numbers are O2's."""
    runs = {}
    for name, kwargs in (("o2", O2_BF16), ("remainder", REMAINDER)):
        runs[name], _ = _fit(kwargs, 2, gradient_clip_val=1e-3)
    for key, value in runs["o2"].state_dict().items():
        assert torch.equal(runs["remainder"].state_dict()[key], value), key


def _fabric_clipped(master_weights: bool | str, algorithm: str) -> dict[str, Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin = FabricAMPPrecision("bf16-mixed", master_weights=master_weights, device="cpu")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for x, y in _data():
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        if algorithm == "norm":
            fabric.clip_gradients(model, opt, max_norm=1e-3)
        else:
            fabric.clip_gradients(model, opt, clip_val=1e-4)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fabric_clip_gradients_acts_on_o2s_fp32_gradients(algorithm: str) -> None:
    """``fabric.clip_gradients`` makes the remainder masters' fp32 gradients before it clips: O2's numbers."""
    o2, remainder = _fabric_clipped(True, algorithm), _fabric_clipped("remainder", algorithm)
    for key, value in o2.items():
        assert torch.equal(remainder[key], value), key
