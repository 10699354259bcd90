"""LossScaleMonitor in real Trainer.fit runs: the scaler's own history is the oracle of the logs."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPFSDPPrecision, AMPPrecision, LossScaleMonitor, LossScaler
from tests._ops import UNSCALE, AtenOps

POISON = (7, 8, 19)  # steps whose gradient gets an inf (0-based)


def _loader(n: int = 40, batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n * batch, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


class Amplify(nn.Module):
    """Multiplies by a large factor: in fp16 its output overflows."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Probe(LightningModule):
    """A small regression model that poisons chosen steps and records the scaler after each step."""

    def __init__(
        self, poison: tuple[int, ...] = POISON, value: float = math.inf, param: str = "net.3.weight",
        amplify: float = 1.0, rank_poison: int | None = None, out_dir: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Amplify(amplify), nn.Linear(16, 1))
        self.poison, self.value, self.param = poison, value, param
        self.rank_poison, self.out_dir = rank_poison, out_dir
        self.seen: list[dict[str, Any]] = []  # per optimizer step: what the scaler says
        self.true_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step in self.poison and self.rank_poison in (None, self.global_rank):
            self.get_parameter(self.param).grad.view(-1)[3] = self.value
        scaler = self.trainer.precision_plugin.scaler
        scale = 1.0 if scaler is None else scaler.get_scale()
        grads = torch.cat([p.grad.flatten() for p in self.parameters()]).double()
        self.true_norms.append(grads.norm().item() / scale)  # still scaled here: divide by the known scale

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scaler = self.trainer.precision_plugin.scaler
        if scaler is not None:
            self.seen.append(
                {
                    "scale": scaler.get_scale(),
                    "skipped": scaler.skipped_steps,
                    "flag": scaler.last_step_skipped,
                }
            )

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            amp = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("amp/")}
            Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))
            Path(self.out_dir, f"metrics{self.global_rank}.json").write_text(json.dumps(amp))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _plugin(init_scale: float = 2.0**10, **kwargs: Any) -> AMPPrecision:
    return AMPPrecision(
        "16-mixed", device="cpu", scaler=LossScaler(init_scale=init_scale, growth_interval=5, **kwargs)
    )


def _fit(
    module: LightningModule, monitor: LossScaleMonitor, plugin: Any = None, steps: int = 30,
    ckpt: str | None = None, **trainer_kwargs: Any,
) -> Trainer:  # fmt: skip
    trainer_kwargs.setdefault("logger", False)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin or _plugin()], callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, _loader(), ckpt_path=ckpt)
    return trainer


def _rows(logger: CSVLogger) -> list[dict[str, float]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _same(a: float, b: float) -> bool:
    return (not math.isfinite(a) and not math.isfinite(b)) or math.isclose(a, b, rel_tol=1e-5)


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Lightning's rank-zero info messages."""
    caplog.set_level("INFO")
    return caplog


@pytest.mark.parametrize("clip", [None, 0.5])
def test_csv_series_match_the_scalers_history(
    tmp_path: Path, clip: float | None, said: pytest.LogCaptureFixture
) -> None:
    module, logger = Probe(), CSVLogger(tmp_path)
    monitor = LossScaleMonitor(warmup_steps=5, window=10, max_skip_rate=0.2, plot_path=tmp_path / "scale.png")
    monitor.plot_events.append((POISON[0], "poisoned batch"))
    with AtenOps() as ops:
        _fit(module, monitor, logger=logger, log_every_n_steps=3, gradient_clip_val=clip)
    assert f"plot of the loss scale and skips written to {tmp_path / 'scale.png'}" in said.text
    assert (tmp_path / "scale.png").stat().st_size > 0
    # The monitor does not look between backward and step: the fast path, where a norm clip reads the
    # scaled gradients (no unscale pass) and otherwise the step unscales and checks once.
    assert ops.counts[UNSCALE] == (0 if clip else len(module.seen))
    rows = [r for r in _rows(logger) if "amp/scale" in r]
    assert [int(r["step"]) for r in rows] == list(range(2, 30, 3))  # log_every_n_steps respected
    flags = [s["flag"] for s in module.seen]
    assert [i for i, f in enumerate(flags) if f] == list(POISON)
    for row in rows:
        step = int(row["step"])
        truth = module.seen[step]
        assert row["amp/scale"] == truth["scale"]
        assert row["amp/skipped_steps"] == truth["skipped"]
        recent = flags[max(0, step + 1 - 10) : step + 1]
        assert row["amp/skip_rate"] == pytest.approx(sum(recent) / len(recent))
        assert _same(row["amp/grad_norm"], module.true_norms[step])
        if clip is None:
            assert "amp/grad_norm_clipped" not in row
        else:
            norm = module.true_norms[step]  # a skipped step has no clipped norm: it was not clipped
            assert _same(row["amp/grad_norm_clipped"], min(norm, clip) if math.isfinite(norm) else math.nan)
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert monitor.health == "sporadic"


def test_value_clipping_logs_the_norm_before_the_clip_and_says_why(
    tmp_path: Path, said: pytest.LogCaptureFixture
) -> None:
    module, logger = Probe(poison=()), CSVLogger(tmp_path)
    _fit(module, LossScaleMonitor(), logger=logger, log_every_n_steps=5, gradient_clip_val=1e-3,
         gradient_clip_algorithm="value")  # fmt: skip
    rows = [r for r in _rows(logger) if "amp/scale" in r]
    assert len(rows) == 6 and all("amp/grad_norm_clipped" not in r for r in rows)
    for row in rows:
        assert _same(row["amp/grad_norm"], module.true_norms[int(row["step"])])  # unscaled, before the clip
    assert said.text.count("amp/grad_norm_clipped is not logged") == 1


def test_tensorboard_gets_the_same_series(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module, logger = Probe(), TensorBoardLogger(tmp_path)
    _fit(module, LossScaleMonitor(), logger=logger, log_every_n_steps=5)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert {"amp/scale", "amp/skipped_steps", "amp/skip_rate", "amp/grad_norm"} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in events.Scalars("amp/scale")] == [
        (s, module.seen[s]["scale"]) for s in range(4, 30, 5)
    ]


def test_bf16_logs_norm_and_skips_and_says_once_why_no_scale(
    tmp_path: Path, said: pytest.LogCaptureFixture
) -> None:
    logger = CSVLogger(tmp_path)
    _fit(Probe(poison=()), LossScaleMonitor(), AMPPrecision("bf16-mixed"), logger=logger, log_every_n_steps=5)
    rows = [r for r in _rows(logger) if "amp/skip_rate" in r]
    assert len(rows) == 6 and all("amp/scale" not in r for r in rows)
    assert all(r["amp/skipped_steps"] == 0 and r["amp/grad_norm"] > 0 for r in rows)
    assert said.text.count("amp/scale is not logged") == 1
    assert "bf16-mixed needs no loss scaler (bf16 has fp32's range)" in said.text


def test_fp32_says_why_no_scale_in_fp32_terms(said: pytest.LogCaptureFixture) -> None:
    _fit(Probe(poison=()), LossScaleMonitor(), AMPPrecision("32-true"), steps=2)
    assert "32-true needs no loss scaler (fp32 gradients do not underflow)" in said.text
    assert "bf16" not in said.text


def test_no_logger_keeps_the_summary_and_says_so_once(said: pytest.LogCaptureFixture) -> None:
    monitor = LossScaleMonitor(warmup_steps=5)
    _fit(Probe(), monitor, accumulate_grad_batches=2, steps=20)
    assert said.text.count("has no logger") == 1
    # 40 batches, 20 optimizer steps: the monitor counts scaler updates, not micro-batches.
    assert monitor.summary().startswith("LossScaleMonitor: 20 steps, 3 skipped")
    assert "LossScaleMonitor: 20 steps" in said.text  # printed at the end of fit


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
def test_resume_continues_counters_and_logs_the_restored_scale(tmp_path: Path) -> None:
    first, probe = LossScaleMonitor(warmup_steps=5), Probe()
    trainer = _fit(probe, first, steps=20)
    path = str(tmp_path / "step20.ckpt")
    trainer.save_checkpoint(path)
    scale, skipped = probe.seen[-1]["scale"], probe.seen[-1]["skipped"]

    second, module, logger = (
        LossScaleMonitor(warmup_steps=5),
        Probe(poison=()),
        CSVLogger(tmp_path, version=1),
    )
    _fit(module, second, _plugin(init_scale=2.0**16), steps=23, ckpt=path, logger=logger, log_every_n_steps=1)
    rows = [r for r in _rows(logger) if "amp/scale" in r]
    assert int(rows[0]["step"]) == 20
    assert rows[0]["amp/scale"] == scale != 2.0**16  # restored, not the new scaler's init_scale
    assert rows[0]["amp/skipped_steps"] == skipped == 3
    n, old, new = len(first.history), first.history, second.history
    assert [r[:3] for r in new[:n]] == [r[:3] for r in old]  # the monitor's own history continues
    assert new[n][:3] == (20, scale, skipped)
    assert second.summary().startswith("LossScaleMonitor: 23 steps, 3 skipped")
    assert second.health == first.health == "sporadic"


def test_raise_stops_training_with_history_and_forensics() -> None:
    monitor = LossScaleMonitor(warmup_steps=3, max_consecutive_skips=4, on_pathological="raise")
    module = Probe(poison=tuple(range(10, 30)))
    with pytest.raises(RuntimeError, match="4 steps in a row were skipped") as info:
        _fit(module, monitor)
    message = str(info.value)
    assert "Steps 1-14 (x = skipped): ..........xxxx" in message
    assert "Recent scale (step: scale):" in message and "13: 512, 14: 256" in message
    assert "Non-finite gradients: net.3.weight (inf in 1 of 16 values, float32)" in message
    assert "trace_nonfinite=True" in message
    assert len(module.seen) == 13  # stopped in the 14th step's on_train_batch_end
    assert monitor.health == "pathological"


@pytest.mark.parametrize(("value", "kind"), [(math.nan, "nan"), (math.inf, "inf")])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "norm-clip"])
def test_first_skip_names_the_nan_parameter(
    said: pytest.LogCaptureFixture, clip: float | None, value: float, kind: str
) -> None:
    # A norm clip of a step with an inf/NaN norm leaves the gradients as they are (torch's factor
    # would make every gradient NaN, and the forensics would blame every parameter).
    monitor = LossScaleMonitor(warmup_steps=3)
    _fit(Probe(poison=(12, 20), value=value, param="net.0.bias"), monitor, gradient_clip_val=clip)
    assert said.text.count(f"Non-finite gradients: net.0.bias ({kind} in 1 of 16 values, float32)") == 1
    assert "step 13 was skipped after warm-up" in said.text and monitor.health == "sporadic"


def test_scale_at_min_scale_is_pathological_and_warns() -> None:
    monitor = LossScaleMonitor(warmup_steps=3)
    plugin = _plugin(init_scale=256.0, min_scale=256.0, max_scale=256.0)
    with pytest.warns(UserWarning, match=r"(?s)sits at min_scale=256.*Non-finite gradients: net.3.weight"):
        _fit(Probe(), monitor, plugin, steps=10)
    assert monitor.health == "pathological"


class _Validating(Probe):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.net(batch[0])


class _TracerWatch(Callback):
    def __init__(self, monitor: LossScaleMonitor) -> None:
        self.monitor, self.attached = monitor, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.attached.append(self.monitor._tracer is not None and self.monitor._tracer.attached)

    def on_validation_batch_start(self, *args: Any) -> None:
        self.attached.append(self.monitor._tracer is not None and self.monitor._tracer.attached)


def test_trace_names_the_overflowing_module(said: pytest.LogCaptureFixture) -> None:
    module, monitor = _Validating(poison=(), amplify=1e5), LossScaleMonitor(trace_nonfinite=True)
    watch = _TracerWatch(monitor)
    trainer = Trainer(
        accelerator="cpu", max_steps=4, plugins=[_plugin()], callbacks=[monitor, watch], logger=False,
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader(), _loader(n=1))
    assert "net.2 (Amplify, float16) produced inf in forward (its output)" in said.text
    assert "HINT: run Amplify in fp32 (AMPPrecision(fp32_modules=(Amplify,)))" in said.text
    # Hooked while training, not while validating, and nothing is left behind.
    assert watch.attached == [True, True, False, True, True, False]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())


def test_needs_amp_precision() -> None:
    with pytest.raises(TypeError, match=r"precision plugin is MixedPrecision.*HINT"):
        _fit(Probe(), LossScaleMonitor(), MixedPrecision("16-mixed", "cpu"), steps=1)


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # FSDPPrecision's CUDA autocast
def test_the_monitor_reads_amp_fsdp_precision_too(tmp_path: Path) -> None:
    """Under Lightning's FSDPStrategy (CUDA only) the plugin is AMPFSDPPrecision: its hooks on a CPU here."""
    logger = CSVLogger(tmp_path)
    scaler = LossScaler("cpu", init_scale=2.0**10, growth_interval=5)
    module, monitor = Probe(), LossScaleMonitor(warmup_steps=5)
    _fit(module, monitor, AMPFSDPPrecision("16-mixed", scaler=scaler), logger=logger, log_every_n_steps=5)
    rows = [r for r in _rows(logger) if "amp/skip_rate" in r]
    assert [r["amp/scale"] for r in rows] == [module.seen[s]["scale"] for s in range(4, 30, 5)]
    assert rows[-1]["amp/skipped_steps"] == len(POISON) == scaler.skipped_steps
    norms = {int(r["step"]): r["amp/grad_norm"] for r in rows}  # asked for: no clip computes it here
    assert all(_same(norm, module.true_norms[step]) for step, norm in norms.items()), norms
    assert monitor.summary().startswith(f"LossScaleMonitor: 30 steps, {len(POISON)} skipped")


@pytest.mark.forks
def test_ddp_rank_zero_writes_and_ranks_agree(tmp_path: Path) -> None:
    # Only rank 1 poisons its (already all-reduced) gradients: the scaler's found_inf sync makes both skip.
    module = Probe(poison=(4, 9), rank_poison=1, out_dir=str(tmp_path))
    logger = CSVLogger(tmp_path, version=0)  # resolved here, not separately in the worker
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=12, plugins=[_plugin()],
        callbacks=[LossScaleMonitor(warmup_steps=2)], logger=logger, log_every_n_steps=2,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader(n=24))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 12
    assert [i for i, s in enumerate(ranks[0]) if s["flag"]] == [4, 9]
    rows = [r for r in _rows(logger) if "amp/scale" in r]
    assert [int(r["step"]) for r in rows] == list(range(1, 12, 2))
    for row in rows:
        truth = ranks[0][int(row["step"])]
        assert (row["amp/scale"], row["amp/skipped_steps"]) == (truth["scale"], truth["skipped"])
    assert len(list(tmp_path.rglob("metrics.csv"))) == 1
    # Every rank's callback_metrics (what its EarlyStopping reads) hold the values rank zero logged last.
    amp = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in (0, 1)]
    assert amp[0] == amp[1] and {k: v for k, v in rows[-1].items() if k.startswith("amp/")} == amp[0]


class _Seen(Callback):
    """Placed after the monitor: callback_metrics' amp/* after each batch, and what loggers got."""

    def __init__(self) -> None:
        self.after_batch: list[dict[str, float]] = []
        self.at_epoch_end: list[dict[str, float]] = []

    @staticmethod
    def _amp(trainer: Trainer) -> dict[str, float]:
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("amp/")}

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.after_batch.append(self._amp(trainer))

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        self.at_epoch_end.append(self._amp(trainer))


class _ListLogger(CSVLogger):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if any(k.startswith("amp/") for k in metrics):
            self.calls.append((int(step or 0), dict(metrics)))
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_callback_metrics_hold_exactly_what_the_logger_got(tmp_path: Path, clip: float | None) -> None:
    seen, logger, module = _Seen(), _ListLogger(tmp_path), Probe()
    trainer = Trainer(
        accelerator="cpu", max_steps=30, plugins=[_plugin()], callbacks=[LossScaleMonitor(window=10), seen],
        logger=logger, log_every_n_steps=3, gradient_clip_val=clip, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader())
    assert [s for s, _ in logger.calls] == list(range(2, 30, 3))
    for step, logged in logger.calls:
        assert set(seen.after_batch[step]) == set(logged)
        assert all(_same(seen.after_batch[step][k], v) for k, v in logged.items())
    assert seen.after_batch[0] == {} and seen.after_batch[2] == seen.after_batch[3]  # kept until the next


def _trainer(*callbacks: Callback, steps: int = 80, **kwargs: Any) -> Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        accelerator="cpu", max_steps=steps, plugins=[_plugin(max_scale=2.0**12)], callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_epoch_end_values_exist_when_no_step_of_the_epoch_is_logged() -> None:
    # 40 batches an epoch, logging every 100 steps: only the epoch's end publishes (and logs nothing).
    seen, module = _Seen(), Probe()
    _trainer(LossScaleMonitor(window=50), seen, log_every_n_steps=100).fit(module, _loader())
    flags = [s["flag"] for s in module.seen]
    assert len(seen.at_epoch_end) == 2 and seen.after_batch[38] == {}
    for values, last in zip(seen.at_epoch_end, (39, 79), strict=True):
        truth, recent = module.seen[last], flags[max(0, last + 1 - 50) : last + 1]
        assert values["amp/scale"] == truth["scale"] and values["amp/skipped_steps"] == truth["skipped"]
        assert values["amp/skip_rate"] == pytest.approx(sum(recent) / len(recent))
        assert "amp/grad_norm" not in values  # no clip and no logged step: nobody computed it
        assert seen.after_batch[last] == values  # published in the epoch's last batch, before epoch end


@pytest.mark.filterwarnings("ignore:.*LossScaleMonitor")
def test_early_stopping_on_the_skip_rate_stops_when_skips_pile_up() -> None:
    from lightning.pytorch.callbacks import EarlyStopping

    # Epoch 0 (steps 0-39) is clean; in epoch 1 ten steps overflow: the rate over 20 steps is 0.5.
    stop = EarlyStopping(monitor="amp/skip_rate", mode="min", patience=100, divergence_threshold=0.2)
    module = Probe(poison=tuple(range(70, 80)))
    trainer = _trainer(stop, LossScaleMonitor(window=20, max_skip_rate=0.9), steps=400, log_every_n_steps=7)
    trainer.fit(module, _loader())
    assert trainer.current_epoch == 2 and trainer.global_step == 80 and stop.stopped_epoch == 1
    assert float(trainer.callback_metrics["amp/skip_rate"]) == 0.5


def test_model_checkpoint_keeps_the_epoch_with_the_highest_scale(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(tmp_path, monitor="amp/scale", mode="max", save_top_k=1, filename="{epoch}")
    module, seen = Probe(poison=(45, 46, 47, 48, 49, 50, 51)), _Seen()
    _trainer(ckpt, LossScaleMonitor(), seen, steps=120, enable_checkpointing=True, log_every_n_steps=50).fit(
        module, _loader()
    )
    scales = [module.seen[s]["scale"] for s in (39, 79, 119)]
    assert [v["amp/scale"] for v in seen.at_epoch_end] == scales
    best = max(range(3), key=lambda e: scales[e])
    assert Path(ckpt.best_model_path).name == f"epoch={best}.ckpt" and ckpt.best_model_score == max(scales)
    assert [p.name for p in tmp_path.glob("*.ckpt")] == [f"epoch={best}.ckpt"]


class _Syncs(Callback):
    """Counts Tensor.item calls (the monitor's host syncs) made between two of these around a callback."""

    def __init__(self, counter: list[int], into: list[int] | None = None) -> None:
        self.counter, self.into = counter, into

    def on_train_batch_end(self, *args: Any) -> None:
        if self.into is None:
            self.counter.append(self.counter[0])
        else:
            self.into.append(self.counter[0] - self.counter.pop())


def test_no_extra_host_sync_on_steps_that_are_neither_logged_nor_an_epochs_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter, per_step = [0], []
    item = torch.Tensor.item

    def counting_item(self: torch.Tensor) -> Any:
        counter[0] += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    trainer = _trainer(_Syncs(counter), LossScaleMonitor(), _Syncs(counter, per_step), steps=40,
                       log_every_n_steps=8)  # fmt: skip
    trainer.fit(Probe(poison=()), _loader(n=20))  # two epochs of 20 steps
    logged, last = {7, 15, 23, 31, 39}, {19, 39}
    # The non-fused step read the skip flag already; the monitor reuses that read.
    assert [n for i, n in enumerate(per_step) if i not in logged | last] == [0] * 34
    assert [per_step[i] for i in sorted(last - logged)] == [2]  # scale (value, floor); skips known


def test_a_mid_epoch_validation_sees_the_values_of_the_step_before_it() -> None:
    class AtValidation(Callback):
        def __init__(self) -> None:
            self.scales: list[tuple[int, float]] = []

        def on_validation_end(self, trainer: Trainer, *args: Any) -> None:
            self.scales.append((trainer.global_step, float(trainer.callback_metrics["amp/scale"])))

    watch, module = AtValidation(), _Validating()
    trainer = _trainer(watch, LossScaleMonitor(), steps=30, log_every_n_steps=100, val_check_interval=10,
                       limit_val_batches=1, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, _loader(), _loader(n=1))
    assert watch.scales == [(s, module.seen[s - 1]["scale"]) for s in (10, 20, 30)]


def _always_overflowing_fit(monitor: LossScaleMonitor | None, steps: int = 40) -> list[str]:
    """fp16 whose every step overflows, at a floor of min_scale=1: the warnings the run gives."""
    plugin = AMPPrecision("16-mixed", device="cpu", scaler=LossScaler(init_scale=4.0, min_scale=1.0))
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, plugins=[plugin], callbacks=[] if monitor is None else [monitor],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Probe(poison=tuple(range(steps))), _loader(n=steps))
    return [str(w.message) for w in caught if "emulates" not in str(w.message)]


def test_a_scale_at_its_floor_is_reported_once_with_the_monitor() -> None:
    said = _always_overflowing_fit(LossScaleMonitor(warmup_steps=5, max_consecutive_skips=3))
    assert len([m for m in said if "min_scale" in m or "floor" in m]) == 1, said


def test_a_long_run_of_skips_is_reported_once_without_the_monitor() -> None:
    said = _always_overflowing_fit(None)
    assert len([m for m in said if "in a row were skipped" in m]) == 1, said


def test_a_bf16_skip_is_not_called_loss_scale_calibration(said: pytest.LogCaptureFixture) -> None:
    """bf16 has no loss scale: a skip in the first steps is a real inf/NaN, not warm-up, and is said so."""
    monitor = LossScaleMonitor()  # warm-up: the first 100 steps, under loss scaling
    _fit(Probe(poison=(1,)), monitor, AMPPrecision("bf16-mixed"), steps=4)
    assert "calibrat" not in said.text and "this is normal" not in said.text
    assert "step 2 was skipped: its loss or a gradient was inf/NaN" in said.text
    assert monitor.health == "sporadic"


def test_bf16_skip_limits_apply_from_the_first_step(said: pytest.LogCaptureFixture) -> None:
    """No warm-up without a loss scale: a full window's skip rate counts from the first step."""
    monitor = LossScaleMonitor(window=4, max_skip_rate=0.3)  # warm-up would be 100 steps under fp16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(Probe(poison=(1, 2)), monitor, AMPPrecision("bf16-mixed"), steps=5)
    assert monitor.health == "pathological"
    assert "skip rate 50.0% over the last 4 steps; health: pathological" in said.text


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_nan_gradient_logs_a_nan_norm_not_the_last_finite_one(tmp_path: Path, clip: float | None) -> None:
    module, logger = Probe(poison=(3,), value=math.nan), CSVLogger(tmp_path)
    trainer = _fit(
        module, LossScaleMonitor(), steps=4, logger=logger, log_every_n_steps=1, gradient_clip_val=clip
    )
    row = next(r for r in _rows(logger) if r.get("step") == 3 and "amp/skipped_steps" in r)
    assert row["amp/skipped_steps"] == 1.0
    assert math.isnan(row["amp/grad_norm"])  # an empty cell before: the key was left out
    assert math.isnan(float(trainer.callback_metrics["amp/grad_norm"]))  # not step 2's finite norm
    if clip is not None:
        assert math.isnan(row["amp/grad_norm_clipped"])


def test_a_skip_while_the_scale_calibrates_names_no_parameter(said: pytest.LogCaptureFixture) -> None:
    # Saying "this is normal" and then listing non-finite gradients alarmed newcomers; the list waits
    # for the first skip after warm-up, which may be a real problem.
    _fit(Probe(poison=(1, 12), value=math.nan, param="net.0.bias"), LossScaleMonitor(warmup_steps=5))
    text = said.text
    assert "step 2 was skipped while the loss scale calibrates" in text
    assert text.count("Non-finite gradients:") == 1
    after = text.split("step 13 was skipped after warm-up", 1)[1]
    assert "Non-finite gradients: net.0.bias (nan in 1 of 16 values" in after
