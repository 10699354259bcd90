"""Run every benchmark at a small size and write a Markdown report with PNG plots.

    python benchmarks/report.py                       # docs/benchmarks.md + docs/img/benchmarks/*.png
    python benchmarks/report.py --quick --out-dir /tmp/report --only memory.py
    python benchmarks/report.py --device cuda         # docs/benchmarks-gpu.md, about 6 minutes on one GPU

Every ``benchmarks/*.py`` except this script and ``_``-prefixed helpers is run as a subprocess
with its ``SMALL_ARGS`` (sizes chosen so the ratios mean something while the whole report
takes about ten minutes on 2 cores) or, with ``--quick``, its ``QUICK_ARGS`` (the smoke runs of
tests/integration/test_benchmarks.py: numbers that mean nothing). A benchmark missing from the
tables runs with ``--quick`` alone. Each writes its JSON, whose headline numbers become a table
and a bar chart (``_report_tables.py``). The header records the machine, the library versions,
the date, the load average and the command. A benchmark that fails is listed as failed, the
others are still reported, and the exit code is 1.

``--device cuda`` runs the GPU subset instead (``GPU_RUNS``: the scripts whose answer changes on
a GPU, at GPU sizes, in order, each with its own timeout, all within ``--budget`` seconds) and
writes ``benchmarks-gpu.md``, with the GPU, CUDA and torchao versions in its header. Without a
CUDA device it refuses before running anything.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QUICK_ARGS: dict[str, str] = {
    "step_overhead.py": "--quick --repeats 2",
    "training_speed.py": "--quick --models tiny tiny-hooks --rounds 1 --tiny-steps 10",
    "monitor_overhead.py": "--quick",
    "ddp_overhead.py": "--quick",
    "fsdp_overhead.py": "--quick",
    "memory.py": "--quick --repeats 1 --steps 1",
    "numerics_speed.py": "--quick",
    "fp32_functions.py": "--quick",
    "compile_speed.py": "--quick --setups bf16 fp16",
    "fabric_speed.py": "--quick --models tiny --rounds 1 --steps 2",
    "fp8.py": "--quick",
    "grad_accumulation.py": "--quick",
}
# Sizes for about ten minutes on a busy 2-core machine.
SMALL_ARGS: dict[str, str] = {
    "step_overhead.py": "--params 50000000 --repeats 15 --threads 1",
    "training_speed.py": "--rounds 5 --steps 20 --tiny-steps 200 --threads 1",
    "monitor_overhead.py": "--steps 30",
    "ddp_overhead.py": "--repeats 15",
    "fsdp_overhead.py": "--repeats 10",
    "memory.py": "--threads 1",
    "numerics_speed.py": "",
    "fp32_functions.py": "--repeats 25",
    "compile_speed.py": "--rounds 3",
    "fabric_speed.py": "--rounds 11",
    "fp8.py": "--dim 64 --steps 16",  # torch._scaled_mm on some CPUs (an Intel Xeon): ~45 ms a small matmul
    "grad_accumulation.py": "--steps 40 --repeats 3",
}


class GpuRun(NamedTuple):
    """One script of the GPU report: its arguments, its smoke arguments and its timeout."""

    args: str
    quick: str
    timeout_s: float


# The GPU report, in the order it runs, each with its timeout: about 6 minutes of one H100/H200 (the
# fp8 compiles take most of it). The other scripts measure CPU-only set-ups (gloo, CPU autocast).
GPU_RUNS: dict[str, GpuRun] = {
    "step_overhead.py": GpuRun("--device cuda --params 400000000 --repeats 20", "--quick --device cuda", 45),
    "fp8.py": GpuRun("--rows speed --recipes tensorwise --warmup 2 --repeats 8", "--quick --rows speed", 240),
    "training_speed.py": GpuRun(
        "--device cuda --models transformer --optimizers fused --rounds 4 --steps 15 --warmup 3",
        "--quick --device cuda --models tiny",
        90,
    ),
    "numerics_speed.py": GpuRun("--device cuda --size 64000000 --repeats 20", "--quick --device cuda", 15),
}
GPU_BUDGET_S = 390.0  # the timeouts above, added up


def benchmarks() -> list[str]:
    """The benchmark scripts: every ``benchmarks/*.py`` but this one and the ``_`` helpers."""
    return sorted(
        p.name for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != Path(__file__).name
    )


def machine(device: str = "cpu") -> dict[str, str]:
    """The CPU model and core counts, library versions, date and load average, as table rows.

    With ``device="cuda"`` the GPU, its CUDA version and torchao's version come first.
    """
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), ""
    )
    cores, block = set(), {}
    for line in [*cpuinfo.splitlines(), ""]:
        if ":" in line:
            key, value = (s.strip() for s in line.split(":", 1))
            block[key] = value
        elif block:
            cores.add((block.get("physical id"), block.get("core id")))
            block = {}
    threads = os.cpu_count() or 0
    physical = len(cores) if cores and (None, None) not in cores else threads
    versions = {}
    for dist in ("torch", "lightning", "amp_plugin", "matplotlib"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    return {
        **(gpu_info() if device == "cuda" else {}),
        "CPU": model or platform.processor() or platform.machine(),
        "cores / hardware threads": f"{physical} / {threads}",
        "OS": platform.platform(),
        "Python": platform.python_version(),
        **{name: version for name, version in versions.items()},
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "OMP_NUM_THREADS for the benchmarks": os.environ.get("OMP_NUM_THREADS", "1"),
        "load average (1, 5, 15 min) at the start": load,
    }


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported only when the GPU report is asked for)."""
    import torch

    return bool(torch.cuda.is_available())


def gpu_info() -> dict[str, str]:
    """The GPU's name and capability, torch's CUDA version and torchao's version, as table rows."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = "not installed (fp8.py needs it)"
    return {
        "GPU": f"{torch.cuda.get_device_name()} (capability {major}.{minor})",
        "GPUs visible": str(torch.cuda.device_count()),
        "CUDA (torch's)": str(torch.version.cuda),
        "torchao": torchao,
    }


def describe(script: str) -> str:
    """The first line of a script's docstring."""
    doc = ast.get_docstring(ast.parse((HERE / script).read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def run_one(script: str, args: list[str], workdir: Path, timeout: float) -> tuple[dict | None, str, float]:
    """Run one benchmark; returns its JSON (None on failure), the tail of its output and seconds."""
    out = workdir / f"{Path(script).stem}.json"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # One intra-op thread unless the caller set OMP_NUM_THREADS (a script's --threads still wins):
    # on a shared machine a parallel op waits for whichever of its threads was preempted.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": pythonpath}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *args, "--json", str(out)],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        seconds = time.perf_counter() - start
        if out.exists():  # a script that writes its JSON as it goes (fp8.py) leaves what it measured
            try:
                return {**json.loads(out.read_text()), "timed_out": timeout}, "", seconds
            except json.JSONDecodeError:
                pass
        return None, f"timed out after {timeout:.0f} s", seconds
    seconds = time.perf_counter() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    if proc.returncode != 0 or not out.exists():
        return None, f"exit code {proc.returncode}: " + " / ".join(tail), seconds
    return json.loads(out.read_text()), "", seconds


def section(
    script: str, args: list[str], payload: dict, seconds: float, img_dir: Path, img_name: str = "benchmarks"
) -> str:
    """One benchmark's Markdown: what it measures, the command, its tables and its plot."""
    import _report_tables as tables

    name = Path(script).stem
    summary = tables.summarize(name, payload)
    parts = [
        f"## {name}",
        "",
        describe(script),
        "",
        f"`{' '.join(['python', f'benchmarks/{script}', *args])}` ({seconds:.0f} s)",
        "",
    ]
    if "timed_out" in payload:
        parts += [
            f"**Timed out** after {payload['timed_out']:.0f} s: the tables show what it measured before.",
            "",
        ]
    for table in summary.tables:
        parts += [tables.markdown(table), ""]
    if summary.bars is not None:
        try:
            tables.plot(summary.bars, img_dir / f"{name}.png")
        except ImportError:  # a GPU image may lack matplotlib: the tables are the report
            parts += ["(No chart: matplotlib is not installed.)", ""]
        else:
            parts += [f"![{name}: {summary.bars.title}](img/{img_name}/{name}.png)", ""]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="the smoke arguments: checks the report, not the code"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: every benchmark, benchmarks.md (default); cuda: the GPU subset, benchmarks-gpu.md",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=ROOT / "docs", help="where the report goes (default docs/)"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="SCRIPT", help="run these benchmarks only (e.g. memory.py)"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="rerun only the --only benchmarks and replace their sections in the existing report",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per benchmark (default 600)")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every benchmark's JSON here, in one file"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole report (default: none on cpu, {GPU_BUDGET_S:.0f} on cuda)",
    )
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    scripts = list(GPU_RUNS) if gpu else benchmarks()
    unknown = sorted(set(args.only or []) - set(scripts))
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: no such benchmark; choose from {', '.join(scripts)}")
    if gpu and not cuda_available():
        parser.error(
            "--device cuda: torch sees no CUDA device on this machine, so there is no GPU report to "
            f"write (torch {_version('torch')}). HINT: run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch, or leave --device out to write the CPU report (docs/benchmarks.md)."
        )
    scripts = [s for s in scripts if not args.only or s in args.only]
    name = "benchmarks-gpu" if gpu else "benchmarks"
    report = args.out_dir / f"{name}.md"
    if args.update and not (args.only and report.exists()):
        parser.error(
            f"--update without --only, or without a report at {report} to update. HINT: name the "
            "benchmarks to rerun (--update --only fp8.py), or leave --update out to write a whole report."
        )
    budget = args.budget if args.budget is not None else (GPU_BUDGET_S if gpu else float("inf"))
    header = machine(args.device)
    img_dir = args.out_dir / "img" / name
    img_dir.mkdir(parents=True, exist_ok=True)
    given = list(argv if argv is not None else sys.argv[1:])
    for where in ("--out-dir", "--json"):  # where the results go changes none of their numbers
        if where in given:
            del given[given.index(where) : given.index(where) + 2]
    command = " ".join(["python benchmarks/report.py", *given])
    sections, failed, start = [], [], time.perf_counter()
    payloads: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            bench_args = arguments(script, args.device, args.quick)
            left = budget - (time.perf_counter() - start)
            if left < MIN_RUN_S:
                failed.append(script)
                sections.append(
                    f"## {Path(script).stem}\n\n**Not run**: the report's budget ({budget:.0f} s) ran out.\n"
                )
                continue
            timeout = min(args.timeout, GPU_RUNS[script].timeout_s if gpu else args.timeout, left)
            print(f"running {script} {' '.join(bench_args)}", flush=True)
            payload, error, seconds = run_one(script, bench_args, Path(tmp), timeout)
            payloads[script] = payload
            if payload is not None and "timed_out" in payload:
                failed.append(script)
                print(f"  TIMED OUT after {payload['timed_out']:.0f} s (partial results kept)", flush=True)
            if payload is None:
                print(f"  FAILED: {error}", flush=True)
                failed.append(script)
                sections.append(f"## {Path(script).stem}\n\n**Failed** ({seconds:.0f} s): {error}\n")
                continue
            try:
                sections.append(section(script, bench_args, payload, seconds, img_dir, name))
            except (KeyError, TypeError, ValueError) as exc:  # its JSON lacks what the summary reads
                failed.append(script)
                sections.append(
                    f"## {Path(script).stem}\n\n**Failed**: its JSON could not be summarized: {exc!r}\n"
                )
    total = time.perf_counter() - start
    header["load average (1, 5, 15 min) at the end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.update:
        new = dict(zip(scripts, sections, strict=True))
        text = updated(report.read_text(), new, command, total, header, args.quick, failed)
    else:
        text = "\n".join([*intro(command, total, header, gpu, args.quick, failed), *sections])
    report.write_text(text.rstrip() + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        results = {"command": command, "machine": header, "failed": failed, "benchmarks": payloads}
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {report} ({len(scripts) - len(failed)} of {len(scripts)} benchmarks) in {total:.0f} s")
    return 1 if failed else 0


def updated(
    old: str,
    new: dict[str, str],
    command: str,
    total: float,
    header: dict[str, str],
    quick: bool = False,
    failed: Sequence[str] = (),
) -> str:
    """``old`` with the sections of the scripts in ``new`` replaced, and a line saying so in its intro."""
    head, *parts = old.split("\n## ")
    sections = {part.split("\n", 1)[0].strip(): "## " + part.rstrip() + "\n" for part in parts}
    for script, section in new.items():
        sections[Path(script).stem] = section
    load = (
        header["load average (1, 5, 15 min) at the start"],
        header["load average (1, 5, 15 min) at the end"],
    )
    note = (
        f"**Updated{' (quick run: the numbers mean nothing)' if quick else ''}**: "
        f"{', '.join(Path(s).stem for s in new)} rerun by `{command}` on "
        f"{header['date (UTC)']} UTC in {total / 60:.1f} minutes (load average {load[0]} at the start, "
        f"{load[1]} at the end; torch {header.get('torch', '?')}); the other sections are from the run above."
    )
    return "\n".join(
        [_refailed(head.rstrip(), new, failed), "", note, "", *(sections[k] for k in sorted(sections))]
    )


def _updates_only(line: str, names: set[str]) -> bool:
    """Whether ``line`` is an update note of benchmarks that are all among ``names``."""
    if not line.startswith("**Updated"):
        return False
    listed = line.split("**: ", 1)[1].split(" rerun by ", 1)[0].split(", ")
    return set(listed) <= names


def _refailed(head: str, rerun: dict[str, str], failed: Sequence[str]) -> str:
    """The intro's list of failed benchmarks after a rerun: the rerun ones as they did this time."""
    # An earlier update of only these benchmarks is superseded by this one.
    rerun_names = {Path(s).stem for s in rerun}
    lines = [ln for ln in head.split("\n") if not _updates_only(ln, rerun_names)]
    before = next((ln for ln in lines if ln.startswith("**Failed**: ")), None)
    names = before[len("**Failed**: ") :].split(" (see")[0].split(", ") if before else []
    names = [n for n in names if n not in rerun] + [s for s in rerun if s in failed]
    line = f"**Failed**: {', '.join(names)} (see their sections)." if names else None
    if before is not None:
        lines = (
            [ln for ln in lines if ln != before]
            if line is None
            else [line if ln == before else ln for ln in lines]
        )
    elif line is not None:
        lines += ["", line]
    return "\n".join(lines)


MIN_RUN_S = 20.0  # a benchmark is not started with less of the budget left


def arguments(script: str, device: str, quick: bool) -> list[str]:
    """The arguments ``script`` runs with in the report for ``device``."""
    if device == "cuda":
        run = GPU_RUNS[script]
        return (run.quick if quick else run.args).split()
    return (QUICK_ARGS if quick else SMALL_ARGS).get(script, "--quick").split()


def intro(
    command: str, total: float, header: dict[str, str], gpu: bool, quick: bool, failed: list[str]
) -> list[str]:
    """The report's title, how it was written, the machine table and its warnings."""
    rows = "\n".join(f"| {key} | {value} |" for key, value in header.items())
    if gpu:
        scope = (
            "It ran the benchmarks whose answer changes on a GPU, at GPU sizes, on one CUDA device; "
            "the CPU report, with every benchmark, is [benchmarks.md](benchmarks.md)."
        )
    else:
        scope = "The GPU report, from `--device cuda`, is [benchmarks-gpu.md](benchmarks-gpu.md)."
    lines = [
        "# Benchmark report" + (" (GPU)" if gpu else ""),
        "",
        f"Written by `{command}` in {total / 60:.1f} minutes. Every benchmark ran once, as a subprocess, "
        "with the arguments shown under its name (sizes picked so that the whole report takes minutes; "
        "each script's docstring and `--help` give its full sizes and what its numbers mean). Ratios "
        "compare cases timed in the same run, interleaved; absolute times depend on the machine and on "
        "how busy it was: a load average above the number of cores means other jobs competed for the CPU. "
        "Under each table a note says what each of its numbers is. " + scope,
        "",
        "| machine | |",
        "|---|---|",
        rows,
        "",
    ]
    if quick:
        lines += ["**Quick run**: smoke sizes, the numbers mean nothing.", ""]
    if failed:
        lines += [f"**Failed**: {', '.join(failed)} (see their sections).", ""]
    return lines


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
