"""FP8 through ``AMPPrecision(fp8=...)``: its error per layer, its loss against bf16, its speed on a GPU.

CPU rows (measured everywhere):

* per-layer SQNR (dB) of the output and of the weight gradient of every fp8-shaped Linear of a
  small transformer (``--dim``), from ``amp_plugin.diagnostics.fp8_report`` on a sample batch of
  real activations, and how long that report took (what ``doctor --fp8`` costs);
* the loss gap: the same model trained ``--steps`` AdamW steps under bf16 autocast and with
  fp8 layers (tensorwise, rowwise), same weights and batches; the mean loss of the last tenth of
  the steps and the relative gap to bf16.

GPU rows (a CUDA device only; skipped on CPU with a note): steps/s of one training step (forward
under bf16 autocast, backward, fused AdamW) of a transformer of width ``--gpu-dim`` (>= 2048) with
its Linear layers in fp8 (the default layer rule) against bf16, as a ratio (target >= 1.3x on an
H100-class GPU), both compiled; and Transformer Engine's ``te.Linear`` under ``fp8_autocast``
where ``transformer_engine`` is installed.

    python benchmarks/fp8.py                  # table
    python benchmarks/fp8.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # on CPU its CUDA kernels cannot load

import torch
from _common import (
    Case,
    default_device,
    environment,
    format_table,
    load_example,
    measure,
    median_ms,
    write_json,
)
from torch import Tensor, nn

from amp_plugin import _imports
from amp_plugin.diagnostics.fp8_report import fp8_hardware, fp8_report
from amp_plugin.fp8 import Float8, convert

VOCAB, SEQ = 256, 64
TARGET = 1.3


EXAMPLE = load_example("fp8")
Block = EXAMPLE.Block  # the example's transformer block and data: one definition


class LM(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def batches(count: int, batch: int, device: str = "cpu") -> list[tuple[Tensor, Tensor]]:
    """The example's bigram token sequences, at this benchmark's vocabulary and length."""
    data = EXAMPLE.bigram_batches(count, batch, vocab=VOCAB, length=SEQ, seed=0)
    return [(tokens.to(device), targets.to(device)) for tokens, targets in data]


def loss_of(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train(dim: int, steps: int, spec: Float8 | None) -> list[float]:
    torch.manual_seed(0)
    model = LM(dim, depth=2)
    if spec is not None:
        convert(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for tokens, targets in batches(steps, batch=8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def cpu_rows(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LM(args.dim, depth=2)
    tokens, _ = batches(1, batch=4)[0]
    started = time.perf_counter()
    report = fp8_report(model, Float8(min_features=64), inputs=tokens)
    doctor_s = time.perf_counter() - started
    bf16 = train(args.dim, args.steps, None)
    tail = max(1, args.steps // 10)
    gaps = []
    for recipe in ("tensorwise", "rowwise"):
        fp8 = train(args.dim, args.steps, Float8(recipe, min_features=64))
        ref, got = sum(bf16[-tail:]) / tail, sum(fp8[-tail:]) / tail
        gaps.append({"recipe": recipe, "bf16_loss": ref, "fp8_loss": got, "gap": (got - ref) / ref})
    return {"layers": report["layers"], "doctor_s": doctor_s, "loss": gaps, "tail": tail}


def gpu_rows(args: argparse.Namespace) -> dict[str, Any]:
    has, why = fp8_hardware()
    if not has:
        return {"skipped": f"needs a GPU with CUDA capability >= 8.9; this machine: {why.partition(' (')[0]}"}
    dim, batch = args.gpu_dim, args.gpu_batch
    data = batches(1, batch=batch, device="cuda")[0]
    cases: list[Case] = []
    for name, spec in (
        ("bf16", None),
        ("fp8 tensorwise", Float8("tensorwise")),
        ("fp8 rowwise", Float8("rowwise")),
    ):
        torch.manual_seed(0)
        model = LM(dim, depth=args.gpu_depth, heads=dim // 128).cuda()
        if spec is not None:
            convert(model, spec)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model)

        def step(compiled: Any = compiled, opt: torch.optim.Optimizer = opt) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(compiled, *data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        cases.append(Case(name, step))
    te_note = _te_case(dim, batch, data, cases)
    samples = measure(cases, device="cuda", warmup=3, repeats=args.repeats)
    base = median_ms(samples["bf16"])
    rows = [
        {"case": name, "ms": median_ms(s), "steps_per_s": 1e3 / median_ms(s), "vs_bf16": base / median_ms(s)}
        for name, s in samples.items()
    ]
    return {"dim": dim, "batch": batch, "rows": rows, "te": te_note, "device": torch.cuda.get_device_name()}


def _te_case(dim: int, batch: int, data: tuple[Tensor, Tensor], cases: list[Case]) -> str:
    """Transformer Engine's te.Linear MLP stack under fp8_autocast, where TE is installed."""
    if _imports.package_version("transformer_engine") is None:
        return "transformer_engine is not installed: no TransformerEnginePrecision row"
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]

    layers = nn.Sequential(*(te.Linear(dim, dim) for _ in range(8))).cuda()
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4, fused=True)
    x = torch.randn(batch * SEQ, dim, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16), te.fp8_autocast(enabled=True):
            out = layers(x)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cases.append(Case("TE Linear x8 (fp8_autocast)", step))
    return "TE row: 8 te.Linear layers only (not the same model): compare its steps/s with care"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dim", type=int, default=128, help="CPU model width, a multiple of 16 (default 128)"
    )
    parser.add_argument("--steps", type=int, default=60, help="CPU training steps per run (default 60)")
    parser.add_argument("--gpu-dim", type=int, default=4096, help="GPU model width, >= 2048 (default 4096)")
    parser.add_argument("--gpu-depth", type=int, default=4, help="GPU model blocks (default 4)")
    parser.add_argument("--gpu-batch", type=int, default=16, help="GPU sequences per step (default 16)")
    parser.add_argument("--repeats", type=int, default=20, help="GPU timed steps per case (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="width 64, 8 steps; GPU: width 2048, 5 repeats")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.dim, args.steps, args.gpu_dim, args.gpu_depth, args.repeats = 64, 8, 2048, 2, 5
    if _imports.torchao_error() is not None:
        print(format_table(["fp8", "result"], [["torchao", f"missing: {_imports.torchao_error()}"]]))
        if args.json:
            write_json(args.json, {"benchmark": "fp8", "environment": environment("cpu"), "skipped": True})
        return
    cpu = cpu_rows(args)
    print(f"fp8 error per Linear layer (width {args.dim}, sample batch of real activations); "
          f"doctor --fp8 took {cpu['doctor_s']:.2f} s")  # fmt: skip
    print(format_table(
        ["layer", "in x out", "fp8 by rule", "output SQNR dB", "weight-grad SQNR dB"],
        [[layer["name"], f"{layer['in_features']}x{layer['out_features']}",
          "yes" if layer["converted"] else "no", _db(layer["output_sqnr_db"]),
          _db(layer["weight_grad_sqnr_db"])] for layer in cpu["layers"]],
    ))  # fmt: skip
    print(f"\nloss after {args.steps} AdamW steps (mean of the last {cpu['tail']}), fp8 vs bf16 autocast")
    print(format_table(
        ["recipe", "bf16 loss", "fp8 loss", "gap"],
        [[g["recipe"], f"{g['bf16_loss']:.4f}", f"{g['fp8_loss']:.4f}", f"{100 * g['gap']:+.2f}%"]
         for g in cpu["loss"]],
    ))  # fmt: skip
    gpu = gpu_rows(args)
    print("\nGPU steps/s, fp8 vs bf16 (target >= 1.3x)")
    if "skipped" in gpu:
        print(format_table(["case", "result"], [["fp8 vs bf16", f"skipped: {gpu['skipped']}"]]))
    else:
        print(format_table(
            ["case", "ms/step", "steps/s", "vs bf16"],
            [[r["case"], f"{r['ms']:.1f}", f"{r['steps_per_s']:.2f}", f"{r['vs_bf16']:.2f}x"]
             for r in gpu["rows"]],
        ))  # fmt: skip
        print(gpu["te"])
    if args.json:
        write_json(args.json, {"benchmark": "fp8", "environment": environment(default_device()), "cpu": cpu,
                               "gpu": gpu, "target": TARGET})  # fmt: skip


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
