"""FP8 through ``AMPPrecision(fp8=...)``: its error per layer, its loss against bf16, its speed on a GPU.

Error rows (``--rows error``, measured on the CPU everywhere):

* per-layer SQNR (dB) of the output and of the weight gradient of every fp8-shaped Linear of a
  small transformer (``--dim``), from ``amp_plugin.diagnostics._fp8_report`` on a sample batch of
  real activations, and how long that report took (what ``doctor --fp8`` costs);
* the loss gap: the same model trained ``--steps`` AdamW steps under bf16 autocast and with
  fp8 layers (tensorwise, rowwise), same weights and batches; the mean loss of the last tenth of
  the steps and the relative gap to bf16.

Speed rows (``--rows speed``; a CUDA device of capability >= 8.9, where fp8 has tensor cores):
one training step (forward under bf16 autocast, backward, fused AdamW) in Lightning Fabric, the
whole model ``torch.compile``-d, at the sizes where fp8 pays (torchao's own tables: about 1.0x
per Linear at 8k tokens x 4096, more at >= 16k tokens with K, N >= 8192):

  8b-blocks   Llama-3-8B-like blocks: width 4096, 32 query / 8 key-value heads (GQA), SwiGLU FFN
              14336, RMSNorm, ``--depth`` blocks, an embedding and an lm_head of ``--vocab`` that
              stay in bf16, ``--tokens`` tokens per step in sequences of ``--seq``
  70b-layer   one Llama-3-70B-like block: width 8192, 64 / 8 heads, SwiGLU FFN 28672, on random
              activations of ``--tokens`` tokens (no embedding, no head)

(no rotary embedding: it is elementwise work, the same in every case.) Each shape runs four cases
in the same interleaved rounds: ``bf16`` (Fabric's ``MixedPrecision("bf16-mixed")``), ``torchao``
(the same, the block Linears converted by hand with torchao's ``convert_to_float8_training``),
``AMPPrecision`` (``amp_plugin.lightning.fabric.AMPPrecision("bf16-mixed", fp8=Float8(recipe, filter=...))``:
the same layers, converted by the plugin, and every step guarded, its default: one
read of the fp32 gradients per step, which torchao's loop does not make) and ``AMPPrecision ...,
guard off`` (``guard=False``: the conversion alone). ``vs bf16`` and ``vs torchao`` are ratios of
the median step times in the table (above 1: faster). Targets (tensorwise): >= 1.15x bf16 on the
8B-like blocks, >= 1.3x on the 70B-like layer, and the plugin >= 0.98x torchao by hand.

Without such a GPU the speed rows are skipped with a note; with ``--quick`` they run at a tiny
size instead (on the CPU, eager): a smoke run of the code path whose numbers mean nothing.

    python benchmarks/fp8.py                          # error rows here, speed rows on an fp8 GPU
    python benchmarks/fp8.py --rows speed --shapes 8b-blocks --recipes tensorwise
    python benchmarks/fp8.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
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
from _report_tables import loss_gap_row
from torch import Tensor, nn

from amp_plugin import _imports
from amp_plugin.diagnostics._fp8_report import fp8_hardware, fp8_report
from amp_plugin.fp8 import RECIPES, Float8, convert

VOCAB, SEQ = 256, 64  # the error rows' language model
TARGETS = {"8b-blocks": 1.15, "70b-layer": 1.3}  # fp8 tensorwise (plugin) / bf16
TARGET_VS_TORCHAO = 0.98  # the plugin / torchao by hand, same recipe

EXAMPLE = load_example("fp8")
Block = EXAMPLE.Block  # the example's transformer block and data: one definition


# -- error rows: the example's small transformer on the CPU ------------------------------------


class LM(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def batches(count: int, batch: int) -> list[tuple[Tensor, Tensor]]:
    """The example's bigram token sequences, at this benchmark's vocabulary and length."""
    return EXAMPLE.bigram_batches(count, batch, vocab=VOCAB, length=SEQ, seed=0)


def loss_of(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train(dim: int, steps: int, spec: Float8 | None, batch: int) -> list[float]:
    torch.manual_seed(0)
    model = LM(dim, depth=2)
    if spec is not None:
        convert(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for tokens, targets in batches(steps, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def error_rows(dim: int, steps: int, batch: int = 8) -> dict[str, Any]:
    """Per-layer SQNR of a width-``dim`` transformer and the loss gap after ``steps`` steps of ``batch``."""
    torch.manual_seed(0)
    model = LM(dim, depth=2)
    tokens, _ = batches(1, batch=max(1, batch // 2))[0]
    started = time.perf_counter()
    report = fp8_report(model, Float8(min_features=64), inputs=tokens)
    doctor_s = time.perf_counter() - started
    bf16 = train(dim, steps, None, batch)
    tail = max(1, steps // 10)
    gaps = []
    for recipe in ("tensorwise", "rowwise"):
        try:
            fp8 = train(dim, steps, Float8(recipe, min_features=64), batch)
        except RuntimeError as err:  # torch < 2.13's CPU _scaled_mm takes one scale per tensor
            if "per-tensor scaling" not in str(err):
                raise
            gaps.append({"recipe": recipe, "skipped": "this torch's CPU _scaled_mm has no rowwise scales"})
            continue
        ref, got = sum(bf16[-tail:]) / tail, sum(fp8[-tail:]) / tail
        gaps.append({"recipe": recipe, "bf16_loss": ref, "fp8_loss": got, "gap": (got - ref) / ref})
    return {"dim": dim, "steps": steps, "layers": report["layers"], "doctor_s": doctor_s, "loss": gaps,
            "tail": tail}  # fmt: skip


# -- speed rows: Llama-like shapes in Fabric ---------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A Llama-like model: ``depth`` blocks, with an embedding and a bf16 head when ``vocab`` is set."""

    name: str
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    depth: int
    vocab: int | None  # None: the blocks alone, on random activations
    tokens: int
    seq: int

    def describe(self) -> str:
        ends = f", embedding + lm_head {self.dim}x{self.vocab} in bf16" if self.vocab else ", no head"
        return (
            f"{self.depth} x (width {self.dim}, {self.heads}/{self.kv_heads} heads, SwiGLU {self.ffn})"
            f"{ends}; {self.tokens:,} tokens/step ({self.tokens // self.seq} x {self.seq})"
        )


SHAPES = {
    "8b-blocks": Shape("8b-blocks", 4096, 14336, 32, 8, depth=2, vocab=32768, tokens=16384, seq=2048),
    "70b-layer": Shape("70b-layer", 8192, 28672, 64, 8, depth=1, vocab=None, tokens=16384, seq=2048),
}
SMOKE = Shape("smoke", 64, 192, 4, 2, depth=1, vocab=128, tokens=64, seq=32)


class LlamaBlock(nn.Module):
    """Pre-norm attention with grouped key-value heads and a SwiGLU FFN, as in Llama 3."""

    def __init__(self, dim: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn, bias=False)  # up
        self.w2 = nn.Linear(ffn, dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.dim) if shape.vocab else None
        self.blocks = nn.Sequential(
            *(LlamaBlock(shape.dim, shape.ffn, shape.heads, shape.kv_heads) for _ in range(shape.depth))
        )
        self.norm = nn.RMSNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False) if shape.vocab else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(x if self.embed is None else self.embed(x))
        return self.norm(h) if self.head is None else self.head(self.norm(h))


def in_blocks(_: nn.Module, name: str) -> bool:
    """The layers fp8 takes in every case: the blocks' Linears (the lm_head stays in bf16)."""
    return name.startswith("blocks.")


def _fabric(plugin: Any, device: str) -> Any:
    from lightning.fabric import Fabric

    return Fabric(accelerator=device, devices=1, plugins=[plugin])


# The cases per recipe besides bf16: torchao's conversion by hand, the plugin as users run it (the
# guard reads the gradients once per step, a cost torchao's loop does not pay) and the plugin with
# the guard off (the conversion alone, against torchao's).
LABELS = ("torchao", "AMPPrecision", "AMPPrecision (guard off)")
_UNGUARDED = ", guard off"


def build_case(label: str, recipe: str, shape: Shape, device: str, compiled: bool) -> Case:
    """One case's model, optimizer and Fabric, set up; its ``run`` is one training step."""
    from lightning.fabric.plugins.precision import MixedPrecision

    from amp_plugin.lightning.fabric import AMPPrecision

    torch.manual_seed(0)
    # Initialised where it trains: a 0.86B-parameter layer is slow to fill on a CPU.
    with torch.device(device):
        model = Llama(shape)
    if label == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, module_filter_fn=in_blocks, config=config)
    if label.startswith("AMPPrecision"):  # "AMPPrecision" guards the step (its default); the other not
        fp8 = Float8(recipe, filter=in_blocks)
        plugin: Any = AMPPrecision("bf16-mixed", device=device, fp8=fp8, guard=label == "AMPPrecision")
    else:
        plugin = MixedPrecision("bf16-mixed", device)
    fabric = _fabric(plugin, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    # Fabric unwraps a compiled model, lets the precision plugin convert it, and compiles it again.
    module, opt = fabric.setup(torch.compile(model) if compiled else model, opt)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch = shape.tokens // shape.seq
    if shape.vocab:
        tokens = torch.randint(shape.vocab, (batch, shape.seq + 1), generator=gen).to(fabric.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs = torch.randn(batch, shape.seq, shape.dim, generator=gen).to(fabric.device)
        targets = None

    def step() -> None:
        out = module(inputs)
        if targets is None:
            loss = out.float().square().mean()
        else:
            loss = nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = "bf16" if label == "bf16" else f"{label.split()[0]} fp8 {recipe}"
    name += _UNGUARDED if "guard off" in label else ""
    return Case(name, step)


def time_shape(
    shape: Shape, recipes: Sequence[str], device: str, compiled: bool, warmup: int, repeats: int
) -> dict[str, Any]:
    """The bf16, torchao and AMPPrecision cases of ``shape``, timed in the same interleaved rounds."""
    cases = [build_case("bf16", "", shape, device, compiled)]
    for recipe in recipes:
        cases += [build_case(label, recipe, shape, device, compiled) for label in LABELS]
    first_s = {}
    for case in cases:  # the first step compiles: timed apart, so its cost is known
        started = time.perf_counter()
        case.run()
        if device == "cuda":
            torch.cuda.synchronize()
        first_s[case.name] = time.perf_counter() - started
    samples = measure(cases, device=device, warmup=warmup, repeats=repeats)
    ms = {name: median_ms(s) for name, s in samples.items()}
    rows = []
    for case in cases:
        row: dict[str, Any] = {
            "case": case.name,
            "ms": ms[case.name],
            "steps_per_s": 1e3 / ms[case.name],
            "tokens_per_s": shape.tokens * 1e3 / ms[case.name],
            "vs_bf16": ms["bf16"] / ms[case.name],
            "first_step_s": first_s[case.name],
        }
        if case.name.startswith("AMPPrecision"):
            torchao = case.name.replace("AMPPrecision", "torchao").removesuffix(_UNGUARDED)
            row["vs_torchao"] = ms[torchao] / ms[case.name]
        rows.append(row)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    del cases
    _free(device)
    return {"shape": shape.name, "describe": shape.describe(), **asdict(shape), "rows": rows,
            "peak_gib": peak, "compiled": compiled}  # fmt: skip


def _free(device: str) -> None:
    torch._dynamo.reset()  # compiled code keeps the models it was traced from alive
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def targets(shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the tensorwise rows: fp8 against bf16, and the plugin against torchao."""
    out = []
    for result in shapes:
        rows = {r["case"]: r for r in result["rows"]}
        ours = rows.get("AMPPrecision fp8 tensorwise")
        if ours is None or result["shape"] not in TARGETS:
            continue
        limit = TARGETS[result["shape"]]
        out.append({"target": f"AMPPrecision fp8 tensorwise / bf16 ({result['shape']})",
                    "value": ours["vs_bf16"], "limit": limit,
                    "passed": ours["vs_bf16"] >= limit})  # fmt: skip
        out.append({"target": f"AMPPrecision / torchao, fp8 tensorwise ({result['shape']})",
                    "value": ours["vs_torchao"], "limit": TARGET_VS_TORCHAO,
                    "passed": ours["vs_torchao"] >= TARGET_VS_TORCHAO})  # fmt: skip
    return out


def speed_rows(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The speed rows: on an fp8 GPU at full size, else a smoke run (``--quick``) or a note.

    ``save`` gets the rows so far after each shape: a run cut short keeps what it measured.
    """
    has, why = fp8_hardware()
    if not has and not args.quick:
        return {"skipped": f"needs a CUDA GPU of capability >= 8.9; this machine: {why.partition(' (')[0]}"}
    device = "cuda" if has else "cpu"
    if args.quick:
        on_gpu = replace(SMOKE, dim=1024, ffn=3072, heads=8, tokens=2048, seq=512)
        shapes = [SMOKE if device == "cpu" else on_gpu]
    else:
        shapes = [replace(SHAPES[n], **_overrides(args, SHAPES[n])) for n in args.shapes]
    compiled = device == "cuda" and not args.quick and not args.eager
    results: list[dict[str, Any]] = []
    smoke = args.quick or device == "cpu"
    speed = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": smoke,
             "shapes": results, "targets": []}  # fmt: skip
    for shape in shapes:
        print(f"  timing {shape.name}: {shape.describe()}", file=sys.stderr, flush=True)
        results.append(time_shape(shape, args.recipes, device, compiled, args.warmup, args.repeats))
        speed["targets"] = [] if smoke else targets(results)
        save(speed)
    return speed


def _overrides(args: argparse.Namespace, shape: Shape) -> dict[str, int]:
    given = {"tokens": args.tokens, "seq": args.seq, "depth": args.depth if shape.vocab else None,
             "vocab": args.vocab if shape.vocab else None}  # fmt: skip
    return {key: value for key, value in given.items() if value is not None}


# -- output ------------------------------------------------------------------------------------


def print_error_rows(cpu: dict[str, Any]) -> None:
    print(f"fp8 error per Linear layer (width {cpu['dim']}, sample batch of real activations); "
          f"doctor --fp8 took {cpu['doctor_s']:.2f} s")  # fmt: skip
    print(format_table(
        ["layer", "in x out", "fp8 by rule", "output SQNR dB", "weight-grad SQNR dB"],
        [[layer["name"], f"{layer['in_features']}x{layer['out_features']}",
          "yes" if layer["converted"] else "no", _db(layer["output_sqnr_db"]),
          _db(layer["weight_grad_sqnr_db"])] for layer in cpu["layers"]],
    ))  # fmt: skip
    print(f"\nloss after {cpu['steps']} AdamW steps (mean of the last {cpu['tail']}), fp8 vs bf16 autocast")
    print(format_table(
        ["recipe", "bf16 loss", "fp8 loss", "gap"],
        [loss_gap_row(g) for g in cpu["loss"]],
    ))  # fmt: skip


def print_speed_rows(speed: dict[str, Any]) -> None:
    if "skipped" in speed:
        print(format_table(["speed rows", "result"], [["fp8 vs bf16", f"skipped: {speed['skipped']}"]]))
        return
    smoke = " (smoke run: the numbers mean nothing)" if speed["smoke"] else ""
    print(f"training steps on {speed['device']}{smoke}; vs bf16 / vs torchao: ratios of the median ms/step")
    for shape in speed["shapes"]:
        print(f"\n{shape['shape']}: {shape['describe']}{'' if shape['compiled'] else ', eager'}")
        print(format_table(
            ["case", "ms/step (median)", "tokens/s", "vs bf16", "vs torchao", "first step s"],
            [[r["case"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['vs_bf16']:.3f}x",
              f"{r['vs_torchao']:.3f}x" if "vs_torchao" in r else "", f"{r['first_step_s']:.1f}"]
             for r in shape["rows"]],
        ))  # fmt: skip
    for t in speed["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        print(f"{verdict}  {t['target']}: {t['value']:.3f}x (target >= {t['limit']}x)")


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add = parser.add_argument
    add("--rows", nargs="+", choices=("error", "speed"), default=["error", "speed"], help="default: both")
    add("--dim", type=int, default=128, help="error rows: model width, a multiple of 16 (default 128)")
    add("--steps", type=int, default=60, help="error rows: training steps per run (default 60)")
    add("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="speed rows (both)")
    add("--recipes", nargs="+", choices=RECIPES, default=["tensorwise", "rowwise"], help="speed rows")
    add("--tokens", type=int, help="speed rows: tokens per step (default 16384)")
    add("--seq", type=int, help="speed rows: sequence length (default 2048)")
    add("--depth", type=int, help="speed rows: 8B-like blocks (default 2)")
    add("--vocab", type=int, help="speed rows: the 8B-like model's vocabulary (default 32768)")
    add("--eager", action="store_true", help="speed rows: do not compile (they are compiled by default)")
    add("--warmup", type=int, default=2, help="speed rows: untimed rounds after the first step (default 2)")
    add("--repeats", type=int, default=10, help="speed rows: timed rounds (default 10)")
    add("--threads", type=int, default=1, help="torch threads (default 1)")
    add(
        "--quick",
        action="store_true",
        help="smoke run: error rows at width 64, 2 steps of 2 sequences; speed rows tiny, 1 recipe",
    )
    add("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        # Few steps: CPUs without an fp8 matmul emulate torch._scaled_mm, at up to 0.1 s a call.
        args.dim, args.steps, args.warmup, args.repeats = 64, 2, 1, 2
        args.recipes = args.recipes[:1]
    payload: dict[str, Any] = {"benchmark": "fp8", "environment": environment(default_device()),
                               "targets": {**TARGETS, "vs_torchao": TARGET_VS_TORCHAO}}  # fmt: skip
    if _imports.torchao_error() is not None:
        print(format_table(["fp8", "result"], [["torchao", f"missing: {_imports.torchao_error()}"]]))
        payload["skipped"] = f"torchao is missing: {_imports.torchao_error()}"
    else:
        quiet()
        if "error" in args.rows:
            payload["cpu"] = error_rows(args.dim, args.steps, batch=2 if args.quick else 8)
            print_error_rows(payload["cpu"])
        if "speed" in args.rows:

            def save(speed: dict[str, Any]) -> None:
                if args.json:
                    write_json(args.json, {**payload, "speed": speed})

            payload["speed"] = speed_rows(args, save)
            print()
            print_speed_rows(payload["speed"])
    if args.json:
        write_json(args.json, payload)


def quiet() -> None:
    """Keep the output to the tables: Lightning's banners and the layer report of every case."""
    import logging

    for name in ("lightning.fabric.utilities.rank_zero", "lightning.fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


if __name__ == "__main__":
    main()
