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
               (transformer, mlp) · Lightning MixedPrecision fp16 with torch.amp.GradScaler ·
               AMPPrecision fp16 with LossScaler (tiny; also transformer and mlp on CUDA)

Every run uses ``gradient_clip_val=1.0``, as the quickstart does (by value for the -hooks models).
A callback times each training batch (forward, backward, clipping, optimizer step) after ``--warmup`` batches;
Trainer start-up is not timed, and a run's samples/s is the batch size over its median step
time. The set-ups of a model run in rotating order in each round, and a ratio is the median
over rounds of the per-round ratio, so a burst of load from another process hits the
set-ups of a round alike. Lightning's ``MixedPrecision`` is the reference for both dtypes
(``Trainer(precision="16-mixed")`` would be bf16 on CPU, so its fp16 is built as
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``).

Targets: AMPPrecision >= 0.98x Lightning's MixedPrecision of the same dtype (every model);
on CPU, AMPPrecision bf16 >= 1.3x fp32 on the matmul-heavy MLP; on CUDA, bf16 and fp16
>= 2x fp32 on the transformer (fp32 there is strict fp32: TF32 stays off, torch's default).

On a shared machine, ``--threads 1`` keeps the numbers usable: torch runs one intra-op thread
per core, and while another process holds a core every parallel op waits for the thread that
cannot run (steps slow down 10x and more on 2 cores).

Run ``python benchmarks/training_speed.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from _common import default_device, environment, format_table, synchronize, write_json
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import AMPPrecision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FP32 = "fp32"
MP_BF16, AMP_BF16 = "Lightning MixedPrecision bf16", "AMPPrecision bf16"
MP_FP16, AMP_FP16 = "Lightning MixedPrecision fp16 + GradScaler", "AMPPrecision fp16 + LossScaler"
TARGET_VS_LIGHTNING = 0.98
TARGET_CPU_VS_FP32 = 1.3
TARGET_CUDA_VS_FP32 = 2.0
FULL = {"rounds": 7, "steps": 30, "tiny_steps": 200, "warmup": 5}
QUICK = {"rounds": 2, "steps": 8, "tiny_steps": 40, "warmup": 3}
_BANNERS = ("available:", "Tip: For seamless cloud logging", "`Trainer.fit` stopped")


def _load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by path: the examples are scripts, not a package."""
    if str(EXAMPLES) not in sys.path:  # the examples import each other's helpers by module name
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLES / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Workload:
    """A model, its data, and the precision set-ups it is trained under."""

    name: str
    describe: str
    make_model: Callable[[int], LightningModule]  # the argument: total optimizer steps
    make_loader: Callable[[], DataLoader[Any]]
    setups: tuple[str, ...]
    steps: int
    clip_algorithm: str = "norm"  # "value" leaves no norm clip after the hooks: the plugin re-checks


class WideMLP(LightningModule):
    """``depth`` hidden ``Linear(width, width)`` + GELU layers: nearly all time is in matmuls."""

    def __init__(self, width: int, depth: int = 4, features: int = 256, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


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


def workloads(device: str, steps: int, tiny_steps: int, warmup: int) -> list[Workload]:
    """The three models with sizes for ``device``; the loaders hold enough batches for one run."""
    quickstart, fp16_example = _load_example("quickstart"), _load_example("fp16_scaler")
    cuda = device == "cuda"
    big = {"d_model": 1024, "layers": 8, "heads": 16, "batch_size": 256}
    tconfig = quickstart.Config(**big) if cuda else quickstart.Config(d_model=256, batch_size=64)
    width = 4096 if cuda else 1024
    main_setups = (FP32, MP_BF16, AMP_BF16, MP_FP16, AMP_FP16) if cuda else (FP32, MP_BF16, AMP_BF16)
    batches, tiny_batches = steps + warmup, tiny_steps + warmup
    # fp16 matmuls on a CPU without native fp16 run many times slower than fp32: the large fp16
    # set-ups are CUDA-only, and on CPU the re-check path is measured on the tiny model.
    hooks_mlp = (
        [
            Workload(
                "mlp-hooks",
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
        Workload(
            "transformer",
            f"quickstart transformer, {tconfig.layers} layers, d_model {tconfig.d_model}, "
            f"batch {tconfig.batch_size} x {quickstart.SEQ_LEN} tokens",
            lambda total: quickstart.MajorityTransformer(tconfig, total_steps=total),
            lambda: DataLoader(
                quickstart.make_dataset(tconfig.batch_size * batches, seed=1), batch_size=tconfig.batch_size
            ),
            main_setups,
            steps,
        ),
        Workload(
            "mlp",
            f"wide MLP, 4 x Linear({width}, {width}), batch 512",
            lambda total: WideMLP(width),
            lambda: _mlp_loader(512, batches),
            main_setups,
            steps,
        ),
        Workload(
            "tiny",
            "fp16 example's MLP 16-64-64-1, batch 32",
            lambda total: fp16_example.Regressor(),
            lambda: DataLoader(fp16_example.make_dataset(32 * tiny_batches, seed=1), batch_size=32),
            (FP32, MP_FP16, AMP_FP16),
            tiny_steps,
        ),
        Workload(
            "tiny-hooks",
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
    """The precision plugin of a set-up; ``None`` is Lightning's default fp32."""
    plugins: dict[str, Callable[[], Precision]] = {
        MP_BF16: lambda: MixedPrecision("bf16-mixed", device),
        AMP_BF16: lambda: AMPPrecision("bf16-mixed", device=device),
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


def train_once(workload: Workload, setup: str, device: str, warmup: int) -> float:
    """Samples/s of one ``Trainer.fit`` (timed batches only), from the same initial weights."""
    torch.manual_seed(0)
    total = warmup + workload.steps
    model = workload.make_model(total)
    plugin = make_plugin(setup, device)
    timer = BatchTimer(device, warmup)
    trainer = Trainer(
        accelerator=device,
        devices=1,
        max_steps=total,
        gradient_clip_val=1.0,
        gradient_clip_algorithm=workload.clip_algorithm,
        plugins=[plugin] if plugin is not None else None,
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, workload.make_loader())
    return timer.samples_per_second


@dataclass
class Result:
    """All rounds of one set-up on one model."""

    model: str
    setup: str
    samples_per_s: list[float]
    vs_fp32: list[float]  # per round, against that round's fp32 run (empty for fp32 itself)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_per_s)

    @property
    def spread(self) -> float:
        """Half the range of the rounds, relative to the median: how noisy the number is."""
        return (max(self.samples_per_s) - min(self.samples_per_s)) / 2 / self.median


def run_workload(workload: Workload, device: str, rounds: int, warmup: int) -> list[Result]:
    per_round: dict[str, list[float]] = {setup: [] for setup in workload.setups}
    for r in range(rounds):
        order = [*workload.setups[r % len(workload.setups) :], *workload.setups[: r % len(workload.setups)]]
        for setup in order:
            per_round[setup].append(train_once(workload, setup, device, warmup))
        print(f"  {workload.name} round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    fp32 = per_round[FP32]
    return [
        Result(workload.name, s, v, [] if s == FP32 else [a / b for a, b in zip(v, fp32, strict=True)])
        for s, v in per_round.items()
    ]


def paired_ratio(results: list[Result], model: str, numerator: str, denominator: str) -> float | None:
    """Median over rounds of numerator/denominator samples/s, from the same round's runs."""
    by_setup = {r.setup: r for r in results if r.model == model}
    if numerator not in by_setup or denominator not in by_setup:
        return None
    pairs = zip(by_setup[numerator].samples_per_s, by_setup[denominator].samples_per_s, strict=True)
    return statistics.median(a / b for a, b in pairs)


def targets(results: list[Result], device: str) -> list[dict[str, Any]]:
    """Each target with its measured ratio and whether it is met."""
    checks: list[tuple[str, str, str, str, float]] = [
        (model, AMP_BF16, MP_BF16, "Lightning MixedPrecision bf16", TARGET_VS_LIGHTNING)
        for model in ("transformer", "mlp")
    ]
    for model in ("tiny", "tiny-hooks", *(("mlp-hooks",) if device == "cuda" else ())):
        checks.append((model, AMP_FP16, MP_FP16, "Lightning MixedPrecision fp16", TARGET_VS_LIGHTNING))
    if device == "cuda":
        checks += [
            ("transformer", AMP_BF16, FP32, "fp32", TARGET_CUDA_VS_FP32),
            ("transformer", AMP_FP16, FP32, "fp32", TARGET_CUDA_VS_FP32),
            ("transformer", AMP_FP16, MP_FP16, "Lightning MixedPrecision fp16", TARGET_VS_LIGHTNING),
        ]
    else:
        checks += [("mlp", AMP_BF16, FP32, "fp32", TARGET_CPU_VS_FP32)]
    out = []
    for model, numerator, denominator, label, threshold in checks:
        ratio = paired_ratio(results, model, numerator, denominator)
        if ratio is not None:
            out.append({
                "target": f"{numerator} >= {threshold:g}x {label} ({model})",
                "ratio": ratio,
                "threshold": threshold,
                "passed": ratio >= threshold,
            })  # fmt: skip
    return out


def report(results: list[Result], checks: list[dict[str, Any]], described: dict[str, str]) -> str:
    rows: list[list[str]] = []
    for result in results:
        if rows and result.setup == FP32:
            rows.append([])  # a rule between models
        vs_fp32 = "1.00x" if result.setup == FP32 else f"{statistics.median(result.vs_fp32):.2f}x"
        rows.append([
            result.model, result.setup, f"{result.median:,.0f}", f"±{result.spread:.0%}", vs_fp32
        ])  # fmt: skip
    table = format_table(["model", "set-up", "samples/s", "spread", "vs fp32"], rows)
    models = "\n".join(f"  {name}: {text}" for name, text in described.items())
    lines = [f"{'PASS' if c['passed'] else 'MISS'}  {c['target']}: {c['ratio']:.3f}x" for c in checks]
    return f"{table}\n\nmodels:\n{models}\n\n" + "\n".join(lines)


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
    chosen = [w for w in workloads(args.device, steps, tiny_steps, warmup) if w.name in args.models]
    results: list[Result] = []
    for workload in chosen:
        results += run_workload(workload, args.device, rounds, warmup)
    checks = targets(results, args.device)
    print(report(results, checks, {w.name: w.describe for w in chosen}))
    payload = {
        "benchmark": "training_speed",
        "environment": environment(args.device),
        "settings": {"rounds": rounds, "warmup": warmup, "steps": steps, "tiny_steps": tiny_steps,
                     "gradient_clip_val": 1.0, "tf32": torch.backends.cuda.matmul.allow_tf32},
        "models": {w.name: w.describe for w in chosen},
        "results": [
            {"model": r.model, "setup": r.setup, "samples_per_s": r.samples_per_s, "median": r.median,
             "vs_fp32": statistics.median(r.vs_fp32) if r.vs_fp32 else 1.0}
            for r in results
        ],
        "targets": checks,
    }  # fmt: skip
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
