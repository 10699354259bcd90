"""Check amp_plugin's Triton norm kernel without a GPU: run it on CPU tensors, and compile it for a GPU.

For a session without a GPU that changes ``amp_plugin/kernels/_triton.py`` (the CUDA tests cannot
run there). Needs a Python with torch and Triton (Triton wheels install on a CPU-only machine):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install -q torch triton numpy lightning-utilities
    PYTHONPATH=. /tmp/tv/bin/python tools/triton_cpu_check.py

1. Runs the kernel under ``TRITON_INTERPRET=1`` (Triton's interpreter reads CPU tensors through
   the same address table) at a small tiling, against an fp64 sum: dtypes, chunk edges, inf/NaN,
   views at odd offsets (both launches).
2. Compiles it ahead of time for sm_90 at the code's tiling and counts the vector loads in the
   PTX (the aligned fp32 loop should be ``ld.global.v4``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from amp_plugin.kernels import _triton

# The interpreter replaces parts of triton.language while it runs, so each check has a process.
COMPILE = "--compile"


def interpreted() -> list[str]:
    failures = []
    saved = _triton._CHUNK, _triton._BLOCK
    _triton._CHUNK, _triton._BLOCK = 256, 64
    try:
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            group = [torch.randn(n, generator=gen).to(dtype) for n in (1, 255, 256, 257, 1000, 3)]
            truth = float(sum((t.double() ** 2).sum() for t in group))
            got = float(_triton.sum_of_squares(group))
            if not math.isclose(got, truth, rel_tol=1e-6):
                failures.append(f"{dtype}: {got} against {truth}")
        flat = torch.randn(1000, generator=gen)
        group = [flat[1:], flat[:5]]  # an unaligned view and an aligned one: both launches
        truth = float((flat[1:].double() ** 2).sum() + (flat[:5].double() ** 2).sum())
        if not math.isclose(float(_triton.sum_of_squares(group)), truth, rel_tol=1e-6):
            failures.append("views at odd offsets")
        for bad in (math.inf, math.nan):
            if math.isfinite(float(_triton.sum_of_squares([torch.ones(300), torch.tensor([1.0, bad])]))):
                failures.append(f"{bad} not seen")
    finally:
        _triton._CHUNK, _triton._BLOCK = saved
    return failures


def compiled() -> None:
    kernel = _triton._kernel()
    for dtype in ("*fp32", "*bf16", "*fp16"):
        for aligned in (True, False):
            signature = {"table": "*i64", "chunks": "i32", "first": "i32", "like": dtype, "out": "*fp32"}
            signature |= {"aligned": "constexpr", "chunk": "constexpr", "block": "constexpr"}
            constants = {"aligned": aligned, "chunk": _triton._CHUNK, "block": _triton._BLOCK}
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
            options = {"num_warps": _triton._WARPS}
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
            vector, every = ptx.count("ld.global.v4"), ptx.count("ld.global")
            print(f"  sm_90 {dtype:6} aligned={aligned!s:5}: ld.global.v4 {vector}, all loads {every}")


def main() -> int:
    if COMPILE in sys.argv:
        compiled()
        return 0
    if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernel is built: start again with it
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        interpret = subprocess.run([sys.executable, __file__], env=env, check=False).returncode
        env.pop("TRITON_INTERPRET")
        compile_run = subprocess.run([sys.executable, __file__, COMPILE], env=env, check=False)
        return interpret or compile_run.returncode
    failures = interpreted()
    print("interpreter:", "ok" if not failures else "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
