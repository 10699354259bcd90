"""What this machine supports for mixed precision, and which precision to use; behind ``doctor``.

Reads versions through package metadata (Lightning is not imported) and initialises CUDA only
when it is available. Plain torch.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from amp_plugin import _imports
from amp_plugin._validation import check_bool, check_number, fail
from amp_plugin.precision import auto_precision_reason, cpuinfo, native_on_cpu, resolve_precision

__all__ = ["device_report", "format_device_report"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PRECISION_NAMES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
_REPEATS = 5  # timed runs per dtype and device: the median and the spread
_SMALL = 64  # the side of the "small model" matmul on CPU
_WIDTH = 88  # columns of the text report
_FAR_SLOWER = 8.0  # fp16 this many times slower than bf16: the CPU emulates fp16


def device_report(measure: bool = True, *, budget_s: float = 0.2) -> dict[str, Any]:
    """Describe this machine for mixed precision, as a JSON-ready dict.

    Keys: ``versions`` (python, torch, lightning, amp_plugin; ``None`` when not installed),
    ``cpu`` (name, ISA level, native bf16 and fp16 instructions, bf16 autocast), ``cuda``
    (available, CUDA version, per device: name, compute capability, memory, bf16, tensor cores),
    ``apex`` (``amp_C`` importable, and why not), ``throughput_tflops`` (measured matmul TFLOP/s
    per device and dtype, the median of 5 timed runs, ``None`` per entry where the dtype fails,
    ``None`` altogether when ``measure`` is false), ``throughput_spread`` (the runs' ``[min,
    max]`` per entry), ``matmul_setup`` (sizes, runs and the intra-op threads they ran on),
    ``small_matmul`` (CPU: fp32 and bf16 on a 64x64 matmul, the size of a small model's layers),
    ``notes`` (what the measurements say, in words), ``recommended_precision`` and ``reason``:
    the choice of ``AMPPrecision(precision="auto")`` on the device Lightning would pick.

    The CPU timings run on one intra-op thread (restored afterwards): on a machine where other
    processes are busy, a thread waiting for its core holds up every op, and the spread between
    runs says how steady the numbers are.

    Args:
        measure: time square matmuls in float32, bfloat16 and float16 on each device.
        budget_s: about how long to time each dtype on each device, in seconds.

    Raises:
        TypeError: ``measure`` is not a bool, or ``budget_s`` not a number.
        ValueError: ``budget_s`` is not a finite number > 0.

    Example:
        >>> report = device_report(measure=False)
        >>> report["recommended_precision"] in ("bf16-mixed", "16-mixed")
        True
    """
    check_bool("device_report", "measure", measure)
    budget_s = check_number("device_report", "budget_s", budget_s, low=0.0, low_open=True,
                            hint="0.2 seconds is plenty.")  # fmt: skip
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_precision("auto", device_type)
    scaling = "no loss scaling needed (fp32's range)" if dtype == torch.bfloat16 else "with loss scaling"
    report: dict[str, Any] = {
        "versions": _versions(),
        "cpu": _cpu(),
        "cuda": _cuda(),
        "apex": {"available": _imports.apex_available(), "reason": _imports.apex_error()},
        "throughput_tflops": None,
        "throughput_spread": None,
        "matmul_setup": None,
        "small_matmul": None,
        "notes": [],
        "recommended_precision": _PRECISION_NAMES[dtype],
        "reason": f"{auto_precision_reason(device_type)}; {scaling}",
    }
    if measure:
        with _one_thread():
            report.update(_measure(budget_s))
        report["notes"] = _notes(report)
    return report


def _notes(report: dict[str, Any]) -> list[str]:
    """What the CPU timings say: fp16 far slower than bf16 is emulated; small bf16 matmuls are slow."""
    notes, cpu = [], report["cpu"]
    rates = report["throughput_tflops"]["cpu"]
    fp16, bf16 = rates["float16"], rates["bfloat16"]
    if fp16 is not None and bf16 is not None and fp16 * _FAR_SLOWER < bf16:
        flags = " (it has no AVX512-FP16 or AMX-FP16)" if cpu["fp16_native"] is False else ""
        cpu["fp16_native"] = False
        notes.append(
            f"native fp16: no. fp16 matmuls ran {bf16 / fp16:.0f}x slower than bf16 here: CPU autocast "
            f"emulates fp16 on this CPU{flags}, so train in bf16 or fp32."
        )
    small = report["small_matmul"]
    if small is not None and small["bfloat16"] is not None and small["bfloat16"] < small["float32"]:
        notes.append(
            f"small models are slower in bf16 on this CPU: a {small['size']}x{small['size']} matmul ran at "
            f"{small['bfloat16'] / small['float32']:.2f}x fp32 in bf16. A model of small layers (like "
            "examples/quickstart.py's, d_model 64) trains faster in fp32 here; bf16 pays off on larger ones."
        )
    return notes


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": _imports.package_version("lightning") or _imports.package_version("pytorch-lightning"),
        "amp_plugin": _imports.package_version("amp_plugin"),
    }


def _probe(name: str) -> bool | None:
    # torch.cpu's ISA probes are private and vary between releases: None means "cannot tell".
    probe: Callable[[], bool] | None = getattr(torch.cpu, name, None)
    return bool(probe()) if probe is not None else None


def _cpu() -> dict[str, Any]:
    avx512_bf16, amx = _probe("_is_avx512_bf16_supported"), _probe("_is_amx_tile_supported")
    native = None if avx512_bf16 is None and amx is None else bool(avx512_bf16 or amx)
    return {
        # Linux names the model in /proc/cpuinfo; platform.processor() often says only "x86_64"
        "name": cpuinfo("model name") or platform.processor() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "bf16_autocast": True,  # CPU autocast supports bf16 on every CPU; speed needs native instructions
        "bf16_native": native,
        "fp16_native": native_on_cpu(torch.float16),  # the CPU's flags; a measurement may say no
    }


def _cuda() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"available": False, "version": torch.version.cuda, "devices": []}
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "bf16": props.major >= 8,
                "tensor_cores": props.major >= 7,  # Volta (7.0) and later
            }
        )
    return {"available": True, "version": torch.version.cuda, "devices": devices}


def _measure(budget_s: float) -> dict[str, Any]:
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    runs = {
        str(d): {name: _matmul_runs(d, dtype, _side(d), budget_s) for name, dtype in _DTYPES.items()}
        for d in devices
    }
    small = {name: _matmul_runs(torch.device("cpu"), _DTYPES[name], _SMALL, budget_s / 2) for name in
             ("float32", "bfloat16")}  # fmt: skip
    return {
        "throughput_tflops": {d: {k: _median(r) for k, r in rates.items()} for d, rates in runs.items()},
        "throughput_spread": {
            d: {k: None if r is None else [min(r), max(r)] for k, r in rates.items()}
            for d, rates in runs.items()
        },
        "matmul_setup": {
            "sizes": {str(d): _side(d) for d in devices},
            "runs": _REPEATS,
            "cpu_threads": torch.get_num_threads(),
        },
        "small_matmul": {"size": _SMALL, **{k: _median(r) for k, r in small.items()}},
    }


def _side(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 256  # small on CPU, where fp16 may lack fast kernels


def _median(rates: list[float] | None) -> float | None:
    return None if rates is None else round(statistics.median(rates), 4)


def _matmul_runs(device: torch.device, dtype: torch.dtype, n: int, budget_s: float) -> list[float] | None:
    """TFLOP/s of ``_REPEATS`` timed runs of an ``n`` x ``n`` matmul; ``None`` where the dtype fails."""
    try:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)

        def seconds(reps: int) -> float:
            start = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        # Doubling the repetitions until one run fills its share of the budget doubles as warm-up.
        reps, share = 1, budget_s / (2 * _REPEATS)
        while seconds(reps) < share and reps <= 2**16:
            reps *= 2
        rates = [2 * n**3 * reps / seconds(reps) / 1e12 for _ in range(_REPEATS)]
    except RuntimeError:  # the dtype has no matmul kernel on this device
        return None
    return [round(r, 4) for r in rates]


def format_device_report(report: dict[str, Any]) -> str:
    """Render :func:`device_report`'s dict as readable text.

    Example:
        >>> print(format_device_report(device_report(measure=False)).splitlines()[0])
        amp_plugin doctor
    """
    keys = ("versions", "cpu", "cuda", "apex", "throughput_tflops", "recommended_precision", "reason")
    # throughput_spread, matmul_setup, small_matmul and notes are optional: older reports lack them
    if not isinstance(report, dict) or not set(keys) <= report.keys():
        got = f"report={type(report).__name__}" + (
            f" with keys {sorted(report)}" if isinstance(report, dict) else ""
        )
        fail(
            "format_device_report",
            passed=got,
            allowed=f"the dict device_report() returns, with keys {', '.join(keys)}",
            hint="pass device_report() (or the 'device' entry of the doctor's JSON).",
            error=TypeError,
        )
    v, cpu, cuda, apex = report["versions"], report["cpu"], report["cuda"], report["apex"]
    lines = [
        "amp_plugin doctor",
        f"  versions     python {v['python']}, torch {v['torch']}, "
        f"lightning {v['lightning'] or 'not installed'}",
        f"  cpu          {cpu['name']} ({cpu['capability']}, {cpu['threads']} threads), bf16 autocast: yes, "
        f"native bf16: {_yes(cpu['bf16_native'])}, native fp16: {_yes(cpu.get('fp16_native'))}",
    ]
    if not cuda["available"]:
        build = f"torch built for CUDA {cuda['version']}" if cuda["version"] else "CPU-only torch build"
        lines.append(f"  cuda         not available ({build})")
    for d in cuda["devices"]:
        lines.append(
            f"  cuda:{d['index']:<7} {d['name']}, compute capability {d['capability']}, "
            f"{d['memory_gib']} GiB, fp16: yes, bf16: {_yes(d['bf16'])}, "
            f"tensor cores: {_yes(d['tensor_cores'])}"
        )
    lines.append(
        f"  apex amp_C   {'importable' if apex['available'] else 'not importable: ' + str(apex['reason'])}"
    )
    lines += _matmul_lines(report)
    lines.append(f"  recommended  precision={report['recommended_precision']!r}: {report['reason']}")
    lines += [f"  note         {note}" for note in report.get("notes") or ()]
    # Rows wrap under their value column, so that the report reads in a terminal and in a page.
    wrap = textwrap.TextWrapper(width=_WIDTH, subsequent_indent=" " * 15, break_on_hyphens=False)
    return "\n".join(row for line in lines for row in (wrap.wrap(line) or [""]))


def _matmul_lines(report: dict[str, Any]) -> list[str]:
    setup, spreads = report.get("matmul_setup") or {}, report.get("throughput_spread") or {}
    lines = []
    for device, rates in (report["throughput_tflops"] or {}).items():
        spread = spreads.get(device, {})
        side = setup.get("sizes", {}).get(device)
        how = f", {side}x{side}" if side else ""
        if setup and device == "cpu":
            how += f", {setup['cpu_threads']} thread{'s' if setup['cpu_threads'] != 1 else ''}"
        if setup:
            how += f", median (min-max) of {setup['runs']} runs"
        lines.append(f"  matmul       {device}{how}, TFLOP/s:")
        lines += [  # one dtype per row: a value and its spread never wrap apart
            f"{'':15}{k} -"
            if r is None
            else f"{'':15}{k} {r:.3g}" + (f" ({_span(spread[k])})" if spread.get(k) else "")
            for k, r in rates.items()
        ]
    small = report.get("small_matmul")
    if small is not None and report["throughput_tflops"] is not None:
        shown = ", ".join(
            f"{k} {'-' if small.get(k) is None else f'{small[k]:.3g}'}" for k in ("float32", "bfloat16")
        )
        lines.append(f"  small matmul cpu, {small['size']}x{small['size']}: {shown} TFLOP/s")
    return lines


def _span(bounds: list[float]) -> str:
    return f"{bounds[0]:.3g}-{bounds[1]:.3g}"


def _yes(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")
