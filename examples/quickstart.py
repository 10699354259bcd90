"""Quickstart: train a small transformer with ``AMPPrecision("auto")`` in Lightning.

The task is built here, deterministically, so nothing is downloaded: each sample is a
sequence of 32 tokens over 8 symbols, and the label is the symbol that occurs most often.
Chance is 1 in 8; the 2-layer transformer is near 90% after 50 steps and at 100% by 150.

The run uses what a real job uses: ``Trainer(plugins=[AMPPrecision("auto")],
gradient_clip_val=1.0)``, AdamW with a one-cycle LR schedule, Lightning's progress bar (plain
progress lines when the output goes to a file or a pipe), and a torchmetrics accuracy on a
held-out set. At the end it prints the precision chosen (and
why), the training throughput, the final loss and accuracy, and what the loss scaler did.

Its time is stable because it pins its threads: one intra-op thread (``--threads``), one
inter-op thread and no DataLoader workers. torch would otherwise start one thread per core,
and on a machine where other processes are busy a thread waiting for its core holds up every
op (60 steps took 1.9 s with one thread, 22.8 s with two, on a busy 2-core machine). A
mixed-precision run ends with short runs of the same model and data in fp32 and in the
chosen precision, two of each (``--fp32-steps`` steps each), timed the same way, to say how
much faster, or slower, mixed precision is on this machine.

Run::

    python examples/quickstart.py                        # bf16 on CPU and on recent GPUs
    python examples/quickstart.py --precision 16-mixed   # fp16 + dynamic loss scaling
    python examples/quickstart.py --precision 32-true    # the fp32 baseline, no plugin
    python examples/quickstart.py --threads 4            # more intra-op threads, on an idle machine
    python examples/quickstart.py --smoke                # a few steps, for tests
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from amp_plugin import AMPPrecision, LossScaleMonitor
from amp_plugin.precision import auto_precision_reason

VOCAB = 8
SEQ_LEN = 32
FAVOURITE_P = 0.08
PRECISIONS = ("auto", "bf16-mixed", "16-mixed", "32-true")
_BANNERS = ("available:", "Tip: For seamless cloud logging", "`Trainer.fit` stopped", "that has Tensor Cores")


@dataclass(frozen=True)
class Config:
    """The model and data sizes; the defaults are what the quickstart trains.

    Small enough that the run takes 15-25 s on the 2-core AMD EPYC development VM (about 85 s
    there with AVX-512 turned off, where the CPU emulates bf16), and still reaching 100%
    validation accuracy.
    """

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    batch_size: int = 32
    train_samples: int = 8192
    val_samples: int = 1024
    lr: float = 2e-3


def make_dataset(n: int, seed: int) -> TensorDataset:
    """``n`` token sequences and, as labels, the symbol that occurs most often in each.

    A random "favourite" symbol replaces each token with probability ``FAVOURITE_P``, so it
    usually, not always, wins (about 6 occurrences against about 3.7 for each other symbol).
    Sequences whose top count is tied are dropped, so every label is well defined.
    """
    g = torch.Generator().manual_seed(seed)
    want = n
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    while want > 0:
        batch = 2 * want
        favourite = torch.randint(0, VOCAB, (batch, 1), generator=g)
        tokens = torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=g)
        tokens = torch.where(torch.rand(batch, SEQ_LEN, generator=g) < FAVOURITE_P, favourite, tokens)
        counts = nn.functional.one_hot(tokens, VOCAB).sum(1)
        top2 = counts.topk(2, dim=1).values
        clear = top2[:, 0] > top2[:, 1]
        xs.append(tokens[clear][:want])
        ys.append(counts.argmax(1)[clear][:want])
        want -= len(ys[-1])
    return TensorDataset(torch.cat(xs), torch.cat(ys))


class MajorityTransformer(LightningModule):
    """Token + position embeddings, a pre-norm transformer encoder, mean pooling, a linear head."""

    def __init__(self, config: Config = Config(), total_steps: int = 300) -> None:
        super().__init__()
        self.config, self.total_steps = config, total_steps
        d = config.d_model
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, config.heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        # Nested tensors only pay off with padding masks, and they warn with norm_first=True.
        self.encoder = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, VOCAB))
        self.val_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.last_loss = torch.tensor(float("nan"))
        self.validated_at = -1  # global step of the last validation

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.head(self.encoder(self.embed(tokens) + self.pos).mean(dim=1))
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        # The logits are bf16/fp16 under autocast; cross-entropy in fp32 keeps the loss exact.
        loss = nn.functional.cross_entropy(self(tokens).float(), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_loss = outputs["loss"]  # a tensor: float() here would wait for the GPU every step

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, labels = batch
        self.val_acc(self(tokens), labels)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.validated_at = self.global_step

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.config.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.config.lr, total_steps=self.total_steps, pct_start=0.1
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Throughput(Callback):
    """Times the training batches (forward, backward, optimizer step) after a warm-up.

    Start-up, validation and the first ``warmup`` batches (allocator and kernel warm-up)
    are left out, so samples/s is the steady-state speed of the training step itself.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.seconds = 0.0
        self.samples = 0
        self._start = 0.0
        self._device: torch.device | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        self._device = pl_module.device
        _synchronize(self._device)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        _synchronize(self._device)
        if trainer.global_step > self.warmup:
            self.seconds += time.perf_counter() - self._start
            self.samples += len(batch[0])

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


class ProgressLines(Callback):
    """Prints a plain line every ``every`` steps: the progress report when stdout is not a terminal.

    Lightning's progress bar redraws one line with carriage returns, which a log file or a CI log
    keeps as one very long line; these lines read the same anywhere.
    """

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            self._say(trainer, lambda name: not name.startswith("val"))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._say(trainer, lambda name: name.startswith("val"))

    @staticmethod
    def _say(trainer: Trainer, which: Callable[[str], bool]) -> None:
        metrics = sorted((k, v) for k, v in trainer.progress_bar_metrics.items() if which(k))
        if trainer.is_global_zero and metrics:
            shown = ", ".join(f"{name} {float(value):.4g}" for name, value in metrics)
            print(f"step {trainer.global_step}/{trainer.max_steps}: {shown}", flush=True)


def progress(every: int) -> tuple[bool, list[Callback]]:
    """``enable_progress_bar`` and the callbacks for the progress report.

    Lightning's bar on a terminal; plain lines (:class:`ProgressLines`) every ``every`` steps when
    stdout goes to a file or a pipe.
    """
    if sys.stdout.isatty():
        return True, []
    return False, [ProgressLines(max(1, every))]


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def quiet_lightning() -> None:
    """Keep the console to the progress bar, AMPPrecision's choice and the summary."""
    # Lightning's hardware banner repeats what the summary prints, and its tip is an advert; both
    # share a logger with the messages worth reading (AMPPrecision's choice, the monitor's verdict).
    # On an Ampere-or-later GPU it also asks for TF32 matmuls: the fp32 comparison is true fp32 on purpose.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not any(banner in record.getMessage() for banner in _BANNERS)
    )
    # The data lives in memory: worker processes would only add start-up time.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def pin_threads(intra_op: int) -> None:
    """Run on ``intra_op`` intra-op threads (0: torch's default, one per core) and one inter-op thread."""
    if intra_op > 0:
        torch.set_num_threads(intra_op)
    # Only settable before the first inter-op work; a second main() in one process keeps the first.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="what to train in (default: auto; 32-true: no plugin)",
    )
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--val-every", type=int, default=50, help="validate every N steps (default: 50)")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (default: auto)")
    parser.add_argument("--log-dir", default="runs", help="CSV logs go to LOG_DIR/quickstart (default: runs)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1; 0: one per core)")
    parser.add_argument("--fp32-steps", type=int, default=40, help="steps per comparison run (0: none)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a small model, for tests")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print the summary, and return its numbers."""
    args = parse_args(argv)
    config, steps, val_every = Config(), args.max_steps, args.val_every
    if args.smoke:
        config = Config(d_model=64, train_samples=512, val_samples=128)
        steps, val_every = min(steps, 12), 6
    quiet_lightning()
    pin_threads(args.threads)
    seed_everything(0, verbose=False)
    wall_start = time.perf_counter()

    model = MajorityTransformer(config, total_steps=steps)
    train_set = make_dataset(config.train_samples, seed=1)
    # The data lives in memory: worker processes would only add start-up time and threads.
    train = DataLoader(train_set, batch_size=config.batch_size, shuffle=True, num_workers=0)
    val = DataLoader(make_dataset(config.val_samples, seed=2), batch_size=256, num_workers=0)
    plugin = None if args.precision == "32-true" else AMPPrecision(args.precision)
    throughput = Throughput(warmup=2 if args.smoke else 5)
    # The monitor reads AMPPrecision's scaler, so the fp32 baseline runs without it.
    monitor = LossScaleMonitor() if plugin is not None else None
    bar, lines = progress(every=min(val_every, 25))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=steps,
        val_check_interval=min(val_every, len(train)),
        check_val_every_n_epoch=None,  # count val_check_interval in steps across epochs
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        plugins=[plugin] if plugin is not None else None,
        callbacks=[throughput, *lines] if monitor is None else [throughput, monitor, *lines],
        logger=CSVLogger(args.log_dir, name="quickstart"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=bar,
    )
    trainer.fit(model, train, val)
    if model.validated_at != trainer.global_step:  # the last validation came before the last step
        trainer.validate(model, val, verbose=False)
    summary = summarize(trainer, plugin, model, throughput, monitor, time.perf_counter() - wall_start)
    summary.update(train_samples=config.train_samples, batch_size=config.batch_size)
    summary.update(layers=config.layers, d_model=config.d_model)
    fp32_steps = min(args.fp32_steps, 8) if args.smoke else args.fp32_steps
    if plugin is not None and fp32_steps > 0:
        precision = summary["precision"]
        summary["vs_fp32"] = compare_with_fp32(config, train, args.accelerator, precision, fp32_steps)
    print_summary(summary)
    return summary


def compare_with_fp32(
    config: Config, train: DataLoader[Any], accelerator: str, precision: str, steps: int
) -> dict[str, float]:
    """Samples/s of short fp32 and ``precision`` runs of fresh copies of the model, timed alike.

    The runs go fp32, mixed, mixed, fp32, so that a drift in the machine's load hits both
    alike; no logger, progress bar or monitor in any of them, so the ratio is the step's own.
    """
    seconds = {"32-true": 0.0, precision: 0.0}
    samples = dict.fromkeys(seconds, 0)
    for name in ("32-true", precision, precision, "32-true"):
        seed_everything(0, verbose=False)
        throughput = Throughput(warmup=min(5, steps // 2))
        trainer = Trainer(
            accelerator=accelerator, devices=1, max_steps=steps, limit_val_batches=0, gradient_clip_val=1.0,
            plugins=None if name == "32-true" else [AMPPrecision(name)], callbacks=[throughput], logger=False,
            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        )  # fmt: skip
        with warnings.catch_warnings():  # no validation here, on purpose
            warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
            trainer.fit(MajorityTransformer(config, total_steps=steps), train)
        seconds[name] += throughput.seconds
        samples[name] += throughput.samples
    return {name: samples[name] / seconds[name] for name in seconds}


def summarize(
    trainer: Trainer,
    plugin: AMPPrecision | None,
    model: MajorityTransformer,
    throughput: Throughput,
    monitor: LossScaleMonitor | None,
    wall_seconds: float,
) -> dict[str, Any]:
    """The numbers the summary prints, as a dict (also what ``main`` returns)."""
    device = trainer.strategy.root_device  # not model.device: Lightning moves the model to the CPU after fit
    if plugin is None:
        precision, why = "32-true", "requested; no plugin"
    else:
        precision = plugin.precision
        why = f"auto: {auto_precision_reason(device.type)}" if plugin.requested == "auto" else "requested"
    scaler = plugin.scaler if plugin is not None else None
    if scaler is not None:
        scaling = (
            f"final scale {scaler.get_scale():g}, skipped {scaler.skipped_steps} of "
            f"{scaler.total_steps} steps"
        )
    elif precision == "bf16-mixed" and plugin is not None and plugin.guard is not None:
        scaling = (
            "none needed for bf16 (it has fp32's exponent range); the guard skipped "
            f"{plugin.guard.skipped_steps} of {plugin.guard.total_steps} steps for inf/NaN"
        )
    else:
        scaling = "none (fp32)"
    if monitor is not None:
        scaling += f"; LossScaleMonitor health: {monitor.health}"
    return {
        "precision": precision,
        "why": why,
        "device": _device_name(device),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": trainer.global_step,
        "samples_per_second": throughput.samples_per_second,
        "final_train_loss": float(model.last_loss),
        "val_accuracy": float(trainer.callback_metrics["val_acc"]),
        "chance_accuracy": 1 / VOCAB,
        "loss_scaling": scaling,
        "log_dir": trainer.log_dir,
        "logged": "loss, val_acc" if monitor is None else "loss, val_acc, amp/*",  # the monitor logs amp/*
        "wall_seconds": wall_seconds,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    intra, inter = torch.get_num_threads(), torch.get_num_interop_threads()
    return (
        f"{device.type} ({intra} intra-op thread{'s' if intra > 1 else ''}, {inter} inter-op "
        f"thread{'s' if inter > 1 else ''}, no DataLoader workers; see --threads)"
    )


def print_summary(summary: dict[str, Any]) -> None:
    samples = summary["train_samples"]
    lines = [
        ("precision", f"{summary['precision']}  ({summary['why']})"),
        ("device", summary["device"]),
        ("model", f"MajorityTransformer ({summary['layers']} encoder layers, d_model {summary['d_model']}), "
                  f"{summary['parameters'] / 1e6:.2f}M parameters"),
        ("data", f"{samples} sequences of {SEQ_LEN} tokens over {VOCAB} symbols, built here; "
                 "label: the most frequent symbol"),
        ("training", f"{summary['steps']} steps of batch {summary['batch_size']} ("
                     f"{summary['steps'] * summary['batch_size'] / samples:.2f} epochs), AdamW, 1cycle LR"),
        ("throughput", f"{summary['samples_per_second']:.0f} samples/s (training steps after warm-up)"),
    ]  # fmt: skip
    if "vs_fp32" in summary:
        fp32, ours = summary["vs_fp32"]["32-true"], summary["vs_fp32"][summary["precision"]]
        verdict = "about as fast" if abs(ours / fp32 - 1) < 0.05 else "faster" if ours > fp32 else "slower"
        lines.append(
            (
                "vs fp32",
                f"{summary['precision']} {ours / fp32:.2f}x fp32 ({ours:.0f} against "
                f"{fp32:.0f} samples/s, 2 short runs of each without logging: {verdict} "
                "on this machine)",
            )
        )
    lines += [
        ("train loss", f"{summary['final_train_loss']:.4f}"),
        ("val accuracy", f"{summary['val_accuracy']:.1%}  (chance {summary['chance_accuracy']:.1%})"),
        ("loss scaling", summary["loss_scaling"]),
        ("wall time", f"{summary['wall_seconds']:.1f} s (data, model, fit, validation; not the comparison)"),
        ("logs", f"{summary['log_dir']}/metrics.csv ({summary['logged']})"),
    ]
    print_key_values("Summary", lines)


def print_key_values(title: str, lines: Sequence[tuple[str, str]]) -> None:
    """Print aligned ``key: value`` lines under a title (the examples' summaries)."""
    width = max(len(key) for key, _ in lines)
    print(f"\n{title}")
    for key, value in lines:
        print(f"  {key + ':':<{width + 1}} {value}")


if __name__ == "__main__":
    main()
