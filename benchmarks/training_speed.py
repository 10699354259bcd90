"""Training throughput in ``Trainer.fit``: fp32 against Lightning's MixedPrecision and AMPPrecision.

One run trains the same models on the same data under every precision set-up and reports
samples/s and ratios:

  transformer  the quickstart's model (examples/quickstart.py: 2 pre-norm encoder layers,
               d_model 256, batch 64 x 32 tokens on CPU; 8 layers, d_model 1024, batch 256 on CUDA)
  mlp          a wide MLP (4 hidden layers of 1024 on CPU, 4096 on CUDA; batch 512), the
               matmul-heavy case where autocast pays most
  tiny         the fp16 example's 16-64-64-1 MLP (examples/fp16_scaler.py), where per-step
               overhead dominates; this is where fp16 + loss scaling runs on CPU
  tiny-hooks,  the tiny MLP and (CUDA only) the wide MLP in fp16 with an
  mlp-hooks    ``on_before_optimizer_step`` hook and value clipping: both plugins unscale
               before the hook, and AMPPrecision re-checks the gradients for inf/NaN after it
               (one extra read)

  set-ups      fp32 (no plugin) · Lightning MixedPrecision bf16 · AMPPrecision bf16
               (transformer, mlp) · AMPPrecision bf16 with a ``SpikeGuard`` watching the loss
               and the gradient norm (transformer) · Lightning MixedPrecision fp16 with
               torch.amp.GradScaler · AMPPrecision fp16 with LossScaler (tiny; also transformer
               and mlp on CUDA)
  optimizers   transformer and mlp train with AdamW(fused=True) and AdamW(fused=False)
               (torch's default: a for-loop on CPU, foreach on CUDA), each a row group of its
               own: AMPPrecision's guard skips a fused step inside the kernel and a non-fused
               one on the host after one read of its flag; MixedPrecision bf16 has no guard.
               The tiny models keep the fp16 example's Adam (non-fused).

Every run uses ``gradient_clip_val=1.0``, as the quickstart does (by value for the -hooks models),
except the fused-AdamW runs, which do not clip: Lightning's MixedPrecision refuses to clip with an
optimizer that unscales inside its step ("does not allow for gradient clipping"), bf16 too.
A callback times each training batch (forward, backward, clipping, optimizer step) after ``--warmup`` batches;
Trainer start-up is not timed, and a run's samples/s is the batch size over its median step
time. The set-ups of a model run in an order that rotates and runs backwards every other
round (each pair runs both ways), and a ratio is the median over rounds of the per-round ratio,
so a burst of load from another process hits the set-ups of a round alike. Lightning's
``MixedPrecision`` is the reference for both dtypes (``Trainer(precision="16-mixed")`` would be
bf16 on CPU, so its fp16 is built as ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``).

Host reads: a separate short run of each set-up (not a timed one) counts the host reads of
each training step, ``torch.ops.aten._local_scalar_dense`` calls (``.item()``, ``bool(tensor)``:
on a GPU each one waits for the device), under a ``TorchDispatchMode``; the table prints the
median over ``READ_STEPS`` steps after ``READ_WARMUP``, next to the other set-ups of the same model.

Targets: AMPPrecision (guarded, its default) >= 0.98x Lightning's MixedPrecision of the same
dtype (bf16 on the transformer and the MLP, with either optimizer; fp16 on mlp-hooks) and
>= 1.00x on the fp16 tiny and tiny-hooks models; the spike guard costs at most 2% of a step
(AMPPrecision bf16 with it >= 0.98x without it, on the transformer, with either optimizer);
on CPU, AMPPrecision bf16 >= 1.3x fp32 on the matmul-heavy MLP; on CUDA, bf16 and fp16 >= 2x
fp32 on the transformer (fp32 there is strict fp32: TF32 stays off, torch's default).

On a shared machine, ``--threads 1`` keeps the numbers usable: torch runs one intra-op thread
per core, and while another process holds a core every parallel op waits for the thread that
cannot run (steps slow down 10x and more on 2 cores).

Run ``python benchmarks/training_speed.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from _common import (
    default_device,
    environment,
    format_table,
    load_example,
    round_order,
    synchronize,
    write_json,
)
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision
from amp_plugin.diagnostics._host_reads import HostReads
from amp_plugin.spike import SpikeGuard

FP32 = "fp32"
MP_BF16, AMP_BF16 = "Lightning MixedPrecision bf16", "AMPPrecision bf16"
AMP_BF16_SPIKE = "AMPPrecision bf16 + SpikeGuard"
MP_FP16, AMP_FP16 = "Lightning MixedPrecision fp16 + GradScaler", "AMPPrecision fp16 + LossScaler"
FUSED, NON_FUSED = "fused", "non-fused"
OPTIMIZER_LABELS = {FUSED: "AdamW fused", NON_FUSED: "AdamW", "example": "Adam"}
TARGET_VS_LIGHTNING = 0.98
TARGET_TINY_VS_LIGHTNING = 1.0  # the fp16 tiny models, where only per-step overhead differs
TARGET_CPU_VS_FP32 = 1.3
TARGET_CUDA_VS_FP32 = 2.0
TARGET_SPIKE_VS_GUARD = 0.98  # the spike guard costs at most 2% of a step
FULL = {"rounds": 7, "steps": 30, "tiny_steps": 200, "warmup": 5}
QUICK = {"rounds": 2, "steps": 8, "tiny_steps": 40, "warmup": 3}
# The host-read count: steps 1..READ_WARMUP create the optimizer state and settle the fp16 scale
# (its first steps overflow and skip, which reads less); the median of the next READ_STEPS is
# reported, a typical step (an fp16 step that overflows now and then reads less).
READ_WARMUP, READ_STEPS = 8, 5
_BANNERS = ("available:", "Tip: For seamless cloud logging", "`Trainer.fit` stopped")


@dataclass(frozen=True)
class Workload:
    """A model with one optimizer, its data, and the precision set-ups it is trained under."""

    name: str
    optimizer: str  # a key of OPTIMIZER_LABELS
    describe: str
    make_model: Callable[[int], LightningModule]  # the argument: total optimizer steps
    make_loader: Callable[[], DataLoader[Any]]
    setups: tuple[str, ...]
    steps: int
    clip_algorithm: str = "norm"  # "value" leaves no norm clip after the hooks: the plugin re-checks
    clip_val: float | None = 1.0  # None: no clipping (Lightning's MixedPrecision cannot clip a fused step)


class WideMLP(LightningModule):
    """``depth`` hidden ``Linear(width, width)`` + GELU layers: nearly all time is in matmuls."""

    def __init__(
        self, width: int, depth: int = 4, features: int = 256, classes: int = 10, fused: bool = False
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))
        self.fused = fused

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)


def _transformer(quickstart: ModuleType, fused: bool) -> type[LightningModule]:
    """The quickstart's transformer, its AdamW built with ``fused`` (same lr, decay and schedule)."""

    class Transformer(quickstart.MajorityTransformer):  # type: ignore[name-defined,misc]
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=self.config.lr, weight_decay=0.01, fused=fused
            )
            schedule = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=self.config.lr, total_steps=self.total_steps, pct_start=0.1
            )
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Transformer


class _Observing:
    """Mixin: a LightningModule that looks at its gradients before the step.

    Overriding ``on_before_optimizer_step`` makes both plugins unscale before the hooks; with
    value clipping AMPPrecision then re-checks the gradients after them (one extra read).
    """

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


def _observing(cls: type[LightningModule]) -> type[LightningModule]:
    return type(f"Observing{cls.__name__}", (_Observing, cls), {})


def _mlp_loader(batch_size: int, batches: int, features: int = 256) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size * batches, features, generator=g)
    y = (x @ torch.randn(features, 10, generator=g)).argmax(1)  # learnable labels, so the loss moves
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def workloads(
    device: str, steps: int, tiny_steps: int, warmup: int, optimizers: Sequence[str] = (FUSED, NON_FUSED)
) -> list[Workload]:
    """The models with sizes for ``device``; the loaders hold enough batches for one run.

    The transformer and the MLP come once per optimizer in ``optimizers``.
    """
    quickstart, fp16_example = load_example("quickstart"), load_example("fp16_scaler")
    cuda = device == "cuda"
    big = {"d_model": 1024, "layers": 8, "heads": 16, "batch_size": 256}
    tconfig = quickstart.Config(**big) if cuda else quickstart.Config(d_model=256, batch_size=64)
    width = 4096 if cuda else 1024
    main_setups = (FP32, MP_BF16, AMP_BF16, MP_FP16, AMP_FP16) if cuda else (FP32, MP_BF16, AMP_BF16)
    transformer_setups = (*main_setups[:3], AMP_BF16_SPIKE, *main_setups[3:])
    batches = max(steps + warmup, READ_WARMUP + READ_STEPS)
    tiny_batches = max(tiny_steps + warmup, READ_WARMUP + READ_STEPS)
    big_models: list[Workload] = []
    for optimizer in optimizers:
        fused = optimizer == FUSED
        # Lightning's MixedPrecision raises on clipping with an optimizer that unscales inside its
        # step (fused AdamW), bf16 too: the fused rows train unclipped, every set-up alike.
        clip_val = None if fused else 1.0
        big_models += [
            Workload(
                "transformer",
                optimizer,
                f"quickstart transformer, {tconfig.layers} layers, d_model {tconfig.d_model}, "
                f"batch {tconfig.batch_size} x {quickstart.SEQ_LEN} tokens",
                lambda total, fused=fused: _transformer(quickstart, fused)(tconfig, total_steps=total),
                lambda: DataLoader(
                    quickstart.make_dataset(tconfig.batch_size * batches, seed=1),
                    batch_size=tconfig.batch_size,
                ),
                transformer_setups,
                steps,
                clip_val=clip_val,
            ),
            Workload(
                "mlp",
                optimizer,
                f"wide MLP, 4 x Linear({width}, {width}), batch 512",
                lambda total, fused=fused: WideMLP(width, fused=fused),
                lambda: _mlp_loader(512, batches),
                main_setups,
                steps,
                clip_val=clip_val,
            ),
        ]
    # fp16 matmuls on a CPU without native fp16 run many times slower than fp32: the large fp16
    # set-ups are CUDA-only, and on CPU the re-check path is measured on the tiny model.
    hooks_mlp = (
        [
            Workload(
                "mlp-hooks",
                NON_FUSED,
                f"the wide MLP ({width}) in fp16 with an on_before_optimizer_step hook and value clipping",
                lambda total: _observing(WideMLP)(width),
                lambda: _mlp_loader(512, batches),
                (FP32, MP_FP16, AMP_FP16),
                steps,
                "value",
            ),
        ]
        if cuda
        else []
    )
    return [
        *big_models,
        Workload(
            "tiny",
            "example",
            "fp16 example's MLP 16-64-64-1, batch 32",
            lambda total: fp16_example.Regressor(),
            lambda: DataLoader(fp16_example.make_dataset(32 * tiny_batches, seed=1), batch_size=32),
            (FP32, MP_FP16, AMP_FP16),
            tiny_steps,
        ),
        Workload(
            "tiny-hooks",
            "example",
            "the tiny MLP with an on_before_optimizer_step hook and value clipping (re-check path)",
            lambda total: _observing(fp16_example.Regressor)(),
            lambda: DataLoader(fp16_example.make_dataset(32 * tiny_batches, seed=1), batch_size=32),
            (FP32, MP_FP16, AMP_FP16),
            tiny_steps,
            "value",
        ),
        *hooks_mlp,
    ]


def make_plugin(setup: str, device: str) -> Precision | None:
    """The precision plugin of a set-up; ``None`` is Lightning's default fp32.

    AMPPrecision runs with its defaults: guarded (a non-finite loss or gradient skips the step) in
    bf16 too, where Lightning's MixedPrecision has no guard.
    """
    plugins: dict[str, Callable[[], Precision]] = {
        MP_BF16: lambda: MixedPrecision("bf16-mixed", device),
        AMP_BF16: lambda: AMPPrecision("bf16-mixed", device=device),
        AMP_BF16_SPIKE: lambda: AMPPrecision(
            "bf16-mixed", device=device, spike_guard=SpikeGuard(on=("loss", "grad_norm"))
        ),
        MP_FP16: lambda: MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device)),
        AMP_FP16: lambda: AMPPrecision("16-mixed", device=device),
    }
    if setup == FP32:
        return None
    if setup not in plugins:
        raise ValueError(f"unknown set-up {setup!r}; allowed: {FP32}, {', '.join(plugins)}")
    return plugins[setup]()


class BatchTimer(Callback):
    """Records the wall time of each training batch after the first ``warmup`` ones."""

    def __init__(self, device: str, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.step_seconds: list[float] = []
        self.batch_size = 0
        self._start, self._seen = 0.0, 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        synchronize(self.device)
        self._seen += 1
        if self._seen > self.warmup:
            self.step_seconds.append(time.perf_counter() - self._start)
            self.batch_size = len(batch[0])

    @property
    def samples_per_second(self) -> float:
        # The median step, not the mean: a step during which another process held the core
        # says nothing about either set-up, and on a shared 2-core machine there are many.
        return self.batch_size / statistics.median(self.step_seconds)


class ReadsPerStep(Callback):
    """The host reads of each whole training step: from one batch's start to the next one's."""

    def __init__(self, mode: HostReads) -> None:
        self.mode = mode
        self.marks: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        self.marks.append(self.mode.count)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.marks.append(self.mode.count)

    @property
    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def _fit(workload: Workload, setup: str, device: str, total: int, callback: Callback) -> None:
    """One ``Trainer.fit`` of ``total`` steps from the same initial weights."""
    torch.manual_seed(0)
    model = workload.make_model(total)
    plugin = make_plugin(setup, device)
    trainer = Trainer(
        accelerator=device,
        devices=1,
        max_steps=total,
        gradient_clip_val=workload.clip_val,
        gradient_clip_algorithm=workload.clip_algorithm,
        plugins=[plugin] if plugin is not None else None,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, workload.make_loader())


def train_once(workload: Workload, setup: str, device: str, warmup: int) -> float:
    """Samples/s of one ``Trainer.fit`` (timed batches only)."""
    timer = BatchTimer(device, warmup)
    _fit(workload, setup, device, warmup + workload.steps, timer)
    return timer.samples_per_second


def count_host_reads(workload: Workload, setup: str, device: str) -> list[int]:
    """Host reads of each of ``READ_STEPS`` training steps after ``READ_WARMUP``, in an untimed run."""
    mode = HostReads(device)  # on a GPU, the reads that wait for it (not those of copies already on the host)
    counter = ReadsPerStep(mode)
    with mode:
        _fit(workload, setup, device, READ_WARMUP + READ_STEPS, counter)
    return counter.per_step[READ_WARMUP:]


@dataclass
class Result:
    """All rounds of one set-up on one model with one optimizer."""

    model: str
    optimizer: str
    setup: str
    samples_per_s: list[float]
    vs_fp32: list[float]  # per round, against that round's fp32 run (empty for fp32 itself)
    host_reads: list[int]  # per step of the counting run

    @property
    def median(self) -> float:
        return statistics.median(self.samples_per_s)

    @property
    def spread(self) -> float:
        """Half the range of the rounds, relative to the median: how noisy the number is."""
        return (max(self.samples_per_s) - min(self.samples_per_s)) / 2 / self.median

    @property
    def reads_per_step(self) -> float:
        return statistics.median(self.host_reads)


def run_workload(workload: Workload, device: str, rounds: int, warmup: int) -> list[Result]:
    reads = {setup: count_host_reads(workload, setup, device) for setup in workload.setups}
    per_round: dict[str, list[float]] = {setup: [] for setup in workload.setups}
    for r in range(rounds):
        for setup in round_order(workload.setups, r):
            per_round[setup].append(train_once(workload, setup, device, warmup))
        print(
            f"  {workload.name} ({workload.optimizer}) round {r + 1}/{rounds} done",
            file=sys.stderr,
            flush=True,
        )
    fp32 = per_round[FP32]
    return [
        Result(
            workload.name, workload.optimizer, s, v,
            [] if s == FP32 else [a / b for a, b in zip(v, fp32, strict=True)], reads[s],
        )
        for s, v in per_round.items()
    ]  # fmt: skip


def _find(results: list[Result], model: str, optimizer: str, setup: str) -> Result | None:
    return next((r for r in results if (r.model, r.optimizer, r.setup) == (model, optimizer, setup)), None)


def paired_ratio(
    results: list[Result], model: str, optimizer: str, numerator: str, denominator: str
) -> float | None:
    """Median over rounds of numerator/denominator samples/s, from the same round's runs."""
    num, den = _find(results, model, optimizer, numerator), _find(results, model, optimizer, denominator)
    if num is None or den is None:
        return None
    return statistics.median(a / b for a, b in zip(num.samples_per_s, den.samples_per_s, strict=True))


def _reads(value: float) -> str:
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def _checks(model: str, device: str) -> list[tuple[str, str, float]]:
    """The targets of one model: (numerator set-up, denominator set-up, threshold)."""
    checks: list[tuple[str, str, float]] = []
    if model in ("transformer", "mlp"):
        checks.append((AMP_BF16, MP_BF16, TARGET_VS_LIGHTNING))
    if model == "transformer":
        checks.append((AMP_BF16_SPIKE, AMP_BF16, TARGET_SPIKE_VS_GUARD))
    if model in ("tiny", "tiny-hooks"):
        checks.append((AMP_FP16, MP_FP16, TARGET_TINY_VS_LIGHTNING))
    if model == "mlp-hooks" or (model == "transformer" and device == "cuda"):
        checks.append((AMP_FP16, MP_FP16, TARGET_VS_LIGHTNING))
    if model == "transformer" and device == "cuda":
        checks += [(AMP_BF16, FP32, TARGET_CUDA_VS_FP32), (AMP_FP16, FP32, TARGET_CUDA_VS_FP32)]
    if model == "mlp" and device == "cpu":
        checks.append((AMP_BF16, FP32, TARGET_CPU_VS_FP32))
    return checks


def targets(results: list[Result], device: str) -> list[dict[str, Any]]:
    """Each target with its measured ratio, whether it is met, and both sides' host reads per step."""
    out = []
    for model, optimizer in dict.fromkeys((r.model, r.optimizer) for r in results):
        for numerator, denominator, threshold in _checks(model, device):
            ratio = paired_ratio(results, model, optimizer, numerator, denominator)
            num, den = (
                _find(results, model, optimizer, numerator),
                _find(results, model, optimizer, denominator),
            )
            if ratio is None or num is None or den is None:
                continue
            label = denominator.split(" + ")[0]  # "Lightning MixedPrecision fp16", "fp32"
            out.append({
                "target": f"{numerator} >= {threshold:g}x {label} ({model}, {OPTIMIZER_LABELS[optimizer]})",
                "model": model,
                "optimizer": optimizer,
                "ratio": ratio,
                "threshold": threshold,
                "passed": ratio >= threshold,
                "host_reads_per_step": num.reads_per_step,
                "baseline_host_reads_per_step": den.reads_per_step,
            })  # fmt: skip
    return out


def report(results: list[Result], checks: list[dict[str, Any]], described: dict[str, str]) -> str:
    rows: list[list[str]] = []
    for result in results:
        if rows and result.setup == FP32:
            rows.append([])  # a rule between models
        vs_fp32 = "1.00x" if result.setup == FP32 else f"{statistics.median(result.vs_fp32):.2f}x"
        rows.append([
            result.model, OPTIMIZER_LABELS[result.optimizer], result.setup, f"{result.median:,.0f}",
            f"±{result.spread:.0%}", vs_fp32, _reads(result.reads_per_step),
        ])  # fmt: skip
    headers = ["model", "optimizer", "set-up", "samples/s", "spread", "vs fp32", "host reads/step"]
    table = format_table(headers, rows)
    models = "\n".join(f"  {name}: {text}" for name, text in described.items())
    lines = [
        f"{'PASS' if c['passed'] else 'MISS'}  {c['target']}: {c['ratio']:.3f}x  (host reads/step "
        f"{_reads(c['host_reads_per_step'])} vs {_reads(c['baseline_host_reads_per_step'])})"
        for c in checks
    ]
    note = (
        f"host reads/step: aten._local_scalar_dense calls per training step, median of steps "
        f"{READ_WARMUP + 1}-{READ_WARMUP + READ_STEPS} of a separate, untimed run"
    )
    return f"{table}\n\nmodels:\n{models}\n{note}\n\n" + "\n".join(lines)


def quiet_lightning() -> None:
    """Keep the output to the table: no banners, no warnings about workers or deprecations."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not any(banner in record.getMessage() for banner in _BANNERS)
    )
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`validation_step` but have no `val_dataloader`.*")
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; nothing to act on here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default=default_device(), help="default: cuda if available")
    names = ("transformer", "mlp", "tiny", "tiny-hooks", "mlp-hooks")
    add("--models", nargs="+", choices=names, default=list(names))
    add("--optimizers", nargs="+", choices=(FUSED, NON_FUSED), default=[FUSED, NON_FUSED],
        help="AdamW variants for the transformer and the MLP (default: both)")  # fmt: skip
    add("--rounds", type=int, help=f"rounds per model (default {FULL['rounds']}, quick {QUICK['rounds']})")
    add("--steps", type=int, help=f"timed steps per run (default {FULL['steps']})")
    add("--tiny-steps", type=int, help=f"timed steps per tiny-model run (default {FULL['tiny_steps']})")
    add("--warmup", type=int, help=f"untimed steps per run (default {FULL['warmup']})")
    add("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    add("--quick", action="store_true", help="fewer rounds and steps: a smoke run, not a measurement")
    add("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available. HINT: use --device cpu.")
    preset = QUICK if args.quick else FULL
    rounds, warmup = args.rounds or preset["rounds"], args.warmup or preset["warmup"]
    steps = args.steps or preset["steps"]
    tiny_steps = args.tiny_steps or preset["tiny_steps"]
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    chosen = [
        w for w in workloads(args.device, steps, tiny_steps, warmup, args.optimizers) if w.name in args.models
    ]
    results: list[Result] = []
    for workload in chosen:
        results += run_workload(workload, args.device, rounds, warmup)
    checks = targets(results, args.device)
    print(report(results, checks, {w.name: w.describe for w in chosen}))
    payload = {
        "benchmark": "training_speed",
        "environment": environment(args.device),
        "settings": {"rounds": rounds, "warmup": warmup, "steps": steps, "tiny_steps": tiny_steps,
                     "gradient_clip_val": {FUSED: None, NON_FUSED: 1.0, "example": 1.0},
                     "tf32": torch.backends.cuda.matmul.allow_tf32, "optimizers": args.optimizers,
                     "read_warmup": READ_WARMUP, "read_steps": READ_STEPS},
        "models": {w.name: w.describe for w in chosen},
        "results": [
            {"model": r.model, "optimizer": r.optimizer, "setup": r.setup, "samples_per_s": r.samples_per_s,
             "median": r.median, "vs_fp32": statistics.median(r.vs_fp32) if r.vs_fp32 else 1.0,
             "host_reads_per_step": r.reads_per_step, "host_reads": r.host_reads}
            for r in results
        ],
        "targets": checks,
    }  # fmt: skip
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
