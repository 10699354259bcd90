"""Per-step cost of unscaling and clipping the gradients, LossScaler vs torch.amp.GradScaler.

The scaler's work per step is memory bound, so every clip path is reported against the
measured copy floor: one read+write copy of the same gradients (``torch._foreach_copy_``).
Passes over the gradients in theory (a read+write counts 2, a read counts 1):

  floor  one read+write copy of the gradients                             2 passes (= 1.00x)
  (a)    GradScaler recipe: unscale_ + clip_grad_norm_(foreach=True)      5 passes
  (b)    LossScaler.clip_grad_norm_, ordinary optimizer: norm and inf     3 passes
         flag in one read of the scaled grads, one multiply by clip_coef / scale
  (f)    LossScaler.clip_grad_norm_, fused optimizer: the same read, the   1 pass
         factor folded into the optimizer's grad_scale (its step is not timed here)
  parts  one read (torch._foreach_norm; on CUDA also the Triton sum of squares that both backends'
         norms take there, amp_plugin.kernels._triton), a multiply by a device factor (torch._foreach_mul_),
         torch's AMP unscale kernel with a device factor: where a clip path's time goes
  (c)    clip + step + update with torch.optim.AdamW(fused=True), GradScaler against LossScaler

Targets (on a GPU): (b) <= 1.6x the copy floor, (f) <= 0.6x. On a CPU the same ratios are
printed; a CPU's fp32 norm is often compute bound, so they say less there.

Every timed repeat starts from the same scaled gradients (copied from a stored master
outside the timed region), with clipping active, no overflow and a scale that does not
move. Run ``python benchmarks/step_overhead.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    Case,
    default_device,
    environment,
    format_table,
    measure,
    median_ms,
    synchronize,
    write_json,
)
from torch import Tensor

from amp_plugin import LossScaler
from amp_plugin._imports import apex_available
from amp_plugin.kernels import BACKENDS, _triton, check_backend, get_kernels

INIT_SCALE = 2.0**16
# Far beyond any run's number of updates, so the scale never grows while we time.
GROWTH_INTERVAL = 1_000_000_000
GRAD_STD = 1e-3  # unscaled gradient magnitude; times 2**16 it stays far from fp32 overflow
MAX_NORM = 1.0  # the unscaled total norm is about GRAD_STD * sqrt(params) = 10 at 100M, so clipping acts
# Two fp32 reductions over 1e8 elements differ by a few 1e-5 (torch's own norm is 2.6e-5 off the
# fp64 truth here, the torch backend's BLAS-based one 1.1e-5), so paths are compared to that.
RTOL = 1e-4
TARGET_CLIP_OVER_FLOOR = 1.6  # (b): one read + one read+write, against the copy's read+write
TARGET_FOLDED_OVER_FLOOR = 0.6  # (f): one read, against the copy's read+write
# A median this far above the fastest repeat means other jobs preempted our threads.
UNSTEADY = 1.5
FULL = {"params": 100_000_000, "tensors": 100, "repeats": 21, "warmup": 3}
QUICK = {"params": 5_000_000, "tensors": 100, "repeats": 5, "warmup": 1}


@dataclass(frozen=True)
class Row:
    """A timed path and how it is reported."""

    key: str
    label: str
    backend: str  # "torch" for torch.amp.GradScaler and the floors, else the LossScaler kernels
    passes: str
    group: str  # "clip" rows compare with the copy floor; "step" rows with (c) GradScaler


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=int, help=f"total gradient elements (default {FULL['params']:,})")
    parser.add_argument("--tensors", type=int, help=f"number of gradient tensors (default {FULL['tensors']})")
    parser.add_argument("--repeats", type=int, help=f"timed repeats per path (default {FULL['repeats']})")
    parser.add_argument("--warmup", type=int, help=f"untimed warm-up rounds (default {FULL['warmup']})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device())
    parser.add_argument(
        "--kernels",
        choices=BACKENDS,
        default="auto",
        help="LossScaler kernel backend; on CUDA with Apex amp_C installed both backends are reported",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's); 1 is steadier on a machine busy with other jobs",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK['params']:,} params")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tensors < 1 or args.params < args.tensors:
        parser.error(f"need 1 <= --tensors <= --params, got --tensors {args.tensors}, --params {args.params}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"need --threads >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device. HINT: use --device cpu.")
    try:
        args.primary = get_kernels(args.kernels, args.device).name
    except RuntimeError as err:
        parser.error(str(err))
    return args


def tensor_sizes(total: int, count: int) -> list[int]:
    """Sizes like a network's: half weight matrices carrying nearly everything, half bias/norm vectors."""
    small = [1024 * (1 + i % 4) for i in range(count // 2)]
    large_count = count - len(small)
    if sum(small) + large_count * 1024 > total:  # too few elements for that shape: split evenly
        return [total // count + (1 if i < total % count else 0) for i in range(count)]
    weights = [(0.5, 1.0, 1.5, 1.0)[i % 4] for i in range(large_count)]
    rest = total - sum(small)
    large = [int(rest * w / sum(weights)) for w in weights]
    large[0] += rest - sum(large)
    sizes: list[int] = []
    for i in range(count):  # interleave, as a model's parameter order would
        sizes.append(large[i // 2] if i % 2 == 0 else small[i // 2])
    return sizes


def total_norm(tensors: list[Tensor]) -> Tensor:
    norm: Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    return norm


def relative_error(actual: list[Tensor], expected: list[Tensor]) -> float:
    """``||actual - expected|| / ||expected||`` over all tensors together."""
    return float(total_norm(list(torch._foreach_sub(actual, expected))) / total_norm(expected))


class Bench:
    """The gradients, optimizers and scalers shared by all paths."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.sizes = tensor_sizes(args.params, args.tensors)
        self.params = [
            torch.nn.Parameter(torch.randn(n, device=self.device, generator=gen) * 0.02) for n in self.sizes
        ]
        # Scaled gradients as a backward pass under scale 2**16 would leave them.
        self.master = [
            torch.randn(n, device=self.device, generator=gen) * (GRAD_STD * INIT_SCALE) for n in self.sizes
        ]
        for param in self.params:
            param.grad = torch.empty_like(param)
        self.grads = [p.grad for p in self.params if p.grad is not None]
        # Only its param_groups are used: a holder for the clip-only paths, never stepped.
        self.holder = torch.optim.SGD(self.params, lr=0.0)
        self.torch_scaler = self.new_torch_scaler()
        # A device factor of about 1 (the parts rows), and the inf flag torch's unscale kernel sets.
        self.factor = torch.full((), 1.0000001, device=self.device)
        self.found_inf = torch.zeros((), device=self.device)
        self.scalers = {name: self.new_scaler(name) for name in args.backends}

    def new_torch_scaler(self) -> torch.amp.GradScaler:
        scaler = torch.amp.GradScaler(
            self.device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
        )
        scaler.scale(torch.ones((), device=self.device))  # the scale tensor is created lazily
        return scaler

    def new_scaler(self, kernels: str) -> LossScaler:
        scaler = LossScaler(
            init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, kernels=check_backend(kernels)
        )
        scaler.scale(torch.ones((), device=self.device))
        return scaler

    def new_fused_adamw(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01, fused=True)

    def regenerate(self) -> None:
        torch._foreach_copy_(self.grads, self.master)

    # -- the paths (what runs inside the timed region) ------------------------------------------

    def torch_clip(self, opt: torch.optim.Optimizer) -> Tensor:
        self.torch_scaler.unscale_(opt)
        return torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)

    def torch_clip_step(self, opt: torch.optim.Optimizer) -> Tensor:
        norm = self.torch_clip(opt)
        self.torch_scaler.step(opt)
        self.torch_scaler.update()
        return norm

    def torch_step(self, opt: torch.optim.Optimizer) -> None:
        self.torch_scaler.step(opt)
        self.torch_scaler.update()

    def ours_clip(self, scaler: LossScaler, opt: torch.optim.Optimizer) -> Tensor:
        return scaler.clip_grad_norm_(opt, MAX_NORM)

    def ours_clip_step(self, scaler: LossScaler, opt: torch.optim.Optimizer) -> Tensor:
        norm = scaler.clip_grad_norm_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return norm

    def floor_copy(self) -> None:
        torch._foreach_copy_(self.grads, self.master)  # reads the master, writes the gradients

    def torch_read(self) -> None:
        torch._foreach_norm(self.grads)

    def triton_read(self) -> None:
        _triton.sum_of_squares(self.grads)  # the read behind both backends' CUDA norm

    def mul_device_factor(self) -> None:
        torch._foreach_mul_(self.grads, self.factor)  # the multiply of (b) and of torch's clip

    def unscale_kernel(self) -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self.found_inf, self.factor)


def check(bench: Bench, backends: Sequence[str]) -> dict[str, Any]:
    """Run every path once and compare it with torch's recipe; exit 1 on a mismatch."""
    failures: list[str] = []
    bench.regenerate()
    truth = math.sqrt(sum(float(g.double().square().sum()) for g in bench.grads)) / INIT_SCALE
    norm_a = bench.torch_clip(bench.holder)
    bench.torch_scaler.update()
    reference = [g.clone() for g in bench.grads]
    norm = float(norm_a)
    coef = MAX_NORM / (norm + 1e-6)
    if not coef < 1.0:
        failures.append(
            f"clipping is inactive (total norm {norm:.4g} <= max_norm {MAX_NORM}); use more --params"
        )
    out: dict[str, Any] = {"total_norm": norm, "clip_coef": coef, "rtol": RTOL, "fp64_norm": truth}
    out["norm_error_vs_fp64_gradscaler"] = abs(norm - truth) / truth
    for name in backends:
        bench.regenerate()
        norm_b = float(bench.ours_clip(bench.scalers[name], bench.holder))
        bench.scalers[name].update()
        out[f"norm_rel_diff_{name}"] = abs(norm_b - norm) / norm
        out[f"norm_error_vs_fp64_{name}"] = abs(norm_b - truth) / truth
        out[f"grad_rel_diff_{name}"] = relative_error(bench.grads, reference)
        if not math.isclose(norm_b, norm, rel_tol=RTOL):
            failures.append(f"[{name}] clip norm {norm_b!r} != torch's {norm!r} (rtol {RTOL})")
        if not out[f"grad_rel_diff_{name}"] <= RTOL:
            failures.append(
                f"[{name}] clipped gradients differ from torch's by {out[f'grad_rel_diff_{name}']:.2e}"
            )
    del reference

    # The folded path: Adam is scale invariant in its first step, so compare exp_avg (which
    # holds (1 - beta1) * the clipped, unscaled gradient) rather than the parameters.
    start = [p.detach().clone() for p in bench.params]
    bench.regenerate()
    torch_opt = bench.new_fused_adamw()
    bench.torch_clip_step(torch_opt)
    expected = [torch_opt.state[p]["exp_avg"] for p in bench.params]
    for name in backends:
        torch._foreach_copy_([p.detach() for p in bench.params], start)
        bench.regenerate()
        our_opt = bench.new_fused_adamw()
        norm_c = float(bench.ours_clip_step(bench.scalers[name], our_opt))
        err = relative_error([our_opt.state[p]["exp_avg"] for p in bench.params], expected)
        out[f"adamw_exp_avg_rel_diff_{name}"] = err
        if not (math.isclose(norm_c, norm, rel_tol=RTOL) and err <= RTOL):
            failures.append(f"[{name}] folded AdamW step differs from torch's (exp_avg rel diff {err:.2e})")
        del our_opt
    torch._foreach_copy_([p.detach() for p in bench.params], start)
    del torch_opt, expected, start
    if failures:
        sys.exit("correctness check failed, timings would be meaningless:\n  " + "\n  ".join(failures))
    return out


def paths(backends: Sequence[str], triton: bool = False) -> list[Row]:
    rows = [
        Row("floor_copy", "floor: one read+write copy (_foreach_copy_)", "torch", "2", "clip"),
        Row("a", "(a) GradScaler.unscale_ + clip_grad_norm_", "torch", "5", "clip"),
    ]
    rows += [Row(f"b_{k}", f"(b) LossScaler.clip_grad_norm_ [{k}]", k, "3", "clip") for k in backends]
    rows += [Row(f"f_{k}", f"(f) LossScaler.clip_grad_norm_, fused [{k}]", k, "1", "clip") for k in backends]
    rows += [
        Row("read_torch", "    part: one read (torch._foreach_norm)", "torch", "1", "clip"),
        Row("mul_tensor", "    part: _foreach_mul_ by a device factor", "torch", "2", "clip"),
        Row("unscale_kernel", "    part: AMP unscale kernel, device factor", "torch", "2", "clip"),
        Row("c_gradscaler", "(c) GradScaler clip + step + update", "torch", "5 + step", "step"),
    ]
    if triton:  # on CUDA, the read both backends' norms take there, after torch's
        read = Row("read_triton", "    part: one read (Triton sum of squares)", "torch", "1", "clip")
        rows.insert([row.key for row in rows].index("read_torch") + 1, read)
    rows += [
        Row(f"c_lossscaler_{k}", f"(c) LossScaler clip + step + update [{k}]", k, "1 + step (+1)", "step")
        for k in backends
    ]
    rows.append(
        Row(
            "c_gradscaler_noclip", "    GradScaler step + update, no clip (ref.)", "torch", "2 + step", "step"
        )
    )
    assert len({row.key for row in rows}) == len(rows), "two paths share a key: their timings would merge"
    return rows


def cases(bench: Bench, rows: Sequence[Row]) -> list[Case]:
    fused = bench.new_fused_adamw()
    runs: dict[str, Callable[[], object]] = {
        "floor_copy": bench.floor_copy,
        "a": lambda: bench.torch_clip(bench.holder),
        "read_torch": bench.torch_read,
        "read_triton": bench.triton_read,
        "mul_tensor": bench.mul_device_factor,
        "unscale_kernel": bench.unscale_kernel,
        "c_gradscaler": lambda: bench.torch_clip_step(fused),
        "c_gradscaler_noclip": lambda: bench.torch_step(fused),
    }
    # The clip-only paths leave their scaler between unscale and update: reset it untimed.
    teardowns: dict[str, Callable[[], object]] = {"a": bench.torch_scaler.update}
    for name, scaler in bench.scalers.items():
        runs[f"b_{name}"] = functools.partial(bench.ours_clip, scaler, bench.holder)
        runs[f"f_{name}"] = functools.partial(bench.ours_clip, scaler, fused)  # folded, not stepped
        runs[f"c_lossscaler_{name}"] = functools.partial(bench.ours_clip_step, scaler, fused)
        teardowns[f"b_{name}"] = teardowns[f"f_{name}"] = scaler.update
    return [
        Case(row.key, runs[row.key], setup=bench.regenerate, teardown=teardowns.get(row.key, lambda: None))
        for row in rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    others = [k for k in ("torch", "apex") if k != args.primary]
    args.backends = [args.primary]
    if device.type == "cuda" and apex_available():
        args.backends += others
    env = environment(device)
    bench = Bench(args)
    sizes = bench.sizes
    print(f"step_overhead: unscale + clip cost per optimizer step ({env['date']})")
    print(f"  device   {device.type} ({env['device_name']}), {env['torch_threads']} torch threads")
    print(f"  torch    {env['torch']}, python {env['python']}")
    if env["load_average"] is not None:
        load = " / ".join(f"{x:.2f}" for x in env["load_average"])
        print(f"  load     {load} (1/5/15 min averages at start; others' jobs on the machine skew timings)")
    print(
        f"  grads    {sum(sizes):,} fp32 elements in {len(sizes)} tensors "
        f"({min(sizes):,} .. {max(sizes):,} each, {sum(sizes) * 4 / 1e6:,.0f} MB)"
    )
    print(
        f"  timing   median of {args.repeats} repeats after {args.warmup} warm-up rounds, paths interleaved;"
    )
    print("           scaled grads restored from a master copy before each repeat (untimed)")
    print(
        f"  scaler   init_scale {INIT_SCALE:g}, growth_interval {GROWTH_INTERVAL:g} (the scale never moves)"
    )
    print(f"  kernels  LossScaler backend(s): {', '.join(args.backends)} (requested {args.kernels!r})")
    checks = check(bench, args.backends)
    print(
        f"  check    unscaled total norm {checks['total_norm']:.4g}, max_norm {MAX_NORM:g} "
        f"-> clip coef {checks['clip_coef']:.3g}; (b) and the folded (c) agree with torch to rtol {RTOL:g}\n"
        f"           norm error vs fp64: GradScaler path {checks['norm_error_vs_fp64_gradscaler']:.1e}, "
        + ", ".join(
            f"[{k[len('norm_error_vs_fp64_') :]}] {v:.1e}"
            for k, v in checks.items()
            if k.startswith("norm_error_vs_fp64_") and not k.endswith("gradscaler")
        )
    )
    print("  passes   over the gradients (read+write = 2, read = 1); 'step' = the fused AdamW step itself,")
    print("           (+1): given grad_scale, the fused step also writes the unscaled grads back")
    print("  ratio    clip rows vs the copy floor; step rows vs (c) GradScaler")
    print()

    rows = paths(args.backends, triton=_triton.usable(bench.grads))
    samples = measure(cases(bench, rows), device=device, warmup=args.warmup, repeats=args.repeats)
    synchronize(device)
    ms = {key: median_ms(values) for key, values in samples.items()}

    # Neither scaler may have backed off (an overflow) or grown while timing.
    drift = {
        "torch": bench.torch_scaler.get_scale(),
        **{name: scaler.get_scale() for name, scaler in bench.scalers.items()},
    }
    skipped = {name: scaler.skipped_steps for name, scaler in bench.scalers.items()}
    if any(v != INIT_SCALE for v in drift.values()) or any(skipped.values()):
        sys.exit(f"a scale moved or a step was skipped while timing: scales {drift}, skipped {skipped}")

    baseline = {"clip": ms["floor_copy"], "step": ms["c_gradscaler"]}
    table: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for row in rows:
        if table and row.group != rows[rows.index(row) - 1].group:
            table.append([])
        ratio = ms[row.key] / baseline[row.group]
        table.append([row.label, f"{ms[row.key]:.1f}", row.passes, f"{ratio:.2f}"])
        results.append(
            {
                "key": row.key,
                "path": row.label.strip(),
                "backend": row.backend,
                "passes": row.passes,
                "ms_median": ms[row.key],
                "ms_min": min(samples[row.key]),
                "ms_max": max(samples[row.key]),
                "samples_ms": samples[row.key],
                "baseline": "floor_copy" if row.group == "clip" else "c_gradscaler",
                "ratio_vs_baseline": ratio,
            }
        )
    print(format_table(["path", "ms (median)", "passes (theory)", "x floor / x (c)"], table))
    print()
    unsteady = [key for key, values in samples.items() if ms[key] > UNSTEADY * min(values)]
    env["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if unsteady:
        print(
            f"WARNING  unsteady timings (median > {UNSTEADY}x the fastest repeat: {', '.join(unsteady)}); "
            "the machine was busy. Rerun when it is idle, or with --threads 1."
        )

    floor = ms["floor_copy"]
    ratios = {
        name: {
            "b_over_floor": ms[f"b_{name}"] / floor,
            "f_over_floor": ms[f"f_{name}"] / floor,
            "b_over_a": ms[f"b_{name}"] / ms["a"],
            "c_lossscaler_over_c_gradscaler": ms[f"c_lossscaler_{name}"] / ms["c_gradscaler"],
            "c_gradscaler_minus_c_lossscaler_ms": ms["c_gradscaler"] - ms[f"c_lossscaler_{name}"],
        }
        for name in args.backends
    }
    ratios["gradscaler"] = {"a_over_floor": ms["a"] / floor}
    where = "" if device.type == "cuda" else " (a GPU target; on this CPU for comparison only)"
    targets: list[dict[str, Any]] = []
    for name in args.backends:
        r = ratios[name]
        for label, value, limit in (
            (f"(b)/floor [{name}]", r["b_over_floor"], TARGET_CLIP_OVER_FLOOR),
            (f"(f)/floor [{name}]", r["f_over_floor"], TARGET_FOLDED_OVER_FLOOR),
        ):
            passed = value <= limit
            targets.append({"name": label, "value": value, "limit": limit, "passed": passed})
            print(f"{'PASS' if passed else 'MISS'}  {label} = {value:.2f}  (target <= {limit}{where})")
        print(
            f"info  (a)/floor = {ratios['gradscaler']['a_over_floor']:.2f}, "
            f"(b)/(a) [{name}] = {r['b_over_a']:.2f}; "
            f"(c) LossScaler/GradScaler [{name}] = {r['c_lossscaler_over_c_gradscaler']:.2f}, "
            f"saves {r['c_gradscaler_minus_c_lossscaler_ms']:.1f} ms per step"
        )

    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "step_overhead",
                "environment": env,
                "config": {
                    "params": sum(sizes),
                    "tensors": len(sizes),
                    "tensor_sizes": sizes,
                    "repeats": args.repeats,
                    "warmup": args.warmup,
                    "max_norm": MAX_NORM,
                    "init_scale": INIT_SCALE,
                    "growth_interval": GROWTH_INTERVAL,
                    "kernels": args.kernels,
                    "backends": args.backends,
                    "quick": args.quick,
                },
                "checks": checks,
                "results": results,
                "ratios": ratios,
                "targets": targets,
                "unsteady": unsteady,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
