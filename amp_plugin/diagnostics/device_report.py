"""What this machine supports for mixed precision, and which precision to use; behind ``doctor``.

Reads versions through package metadata (Lightning is not imported) and initialises CUDA only
when it is available. Plain torch.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from amp_plugin import _imports
from amp_plugin._validation import check_bool, check_number, fail
from amp_plugin.precision import auto_precision_reason, resolve_precision

__all__ = ["device_report", "format_device_report"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PRECISION_NAMES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


def device_report(measure: bool = True, *, budget_s: float = 0.2) -> dict[str, Any]:
    """Describe this machine for mixed precision, as a JSON-ready dict.

    Keys: ``versions`` (python, torch, lightning, amp_plugin; ``None`` when not installed),
    ``cpu`` (name, ISA level, native bf16 instructions, bf16 autocast), ``cuda`` (available,
    CUDA version, per device: name, compute capability, memory, bf16, tensor cores),
    ``apex`` (``amp_C`` importable, and why not), ``throughput_tflops`` (measured matmul
    TFLOP/s per device and dtype, ``None`` per entry where the dtype fails, ``None``
    altogether when ``measure`` is false), ``recommended_precision`` and ``reason``: the
    choice of ``AMPPrecision(precision="auto")`` on the device Lightning would pick.

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
    return {
        "versions": _versions(),
        "cpu": _cpu(),
        "cuda": _cuda(),
        "apex": {"available": _imports.apex_available(), "reason": _imports.apex_error()},
        "throughput_tflops": _throughput(budget_s) if measure else None,
        "recommended_precision": _PRECISION_NAMES[dtype],
        "reason": f"{auto_precision_reason(device_type)}; {scaling}",
    }


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


def _cpu_name() -> str:
    try:  # Linux names the model here; platform.processor() often says only "x86_64"
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu() -> dict[str, Any]:
    avx512_bf16, amx = _probe("_is_avx512_bf16_supported"), _probe("_is_amx_tile_supported")
    native = None if avx512_bf16 is None and amx is None else bool(avx512_bf16 or amx)
    return {
        "name": _cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "bf16_autocast": True,  # CPU autocast supports bf16 on every CPU; speed needs native instructions
        "bf16_native": native,
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


def _throughput(budget_s: float) -> dict[str, dict[str, float | None]]:
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return {
        str(d): {name: _matmul_tflops(d, dtype, budget_s) for name, dtype in _DTYPES.items()} for d in devices
    }


def _matmul_tflops(device: torch.device, dtype: torch.dtype, budget_s: float) -> float | None:
    n = 4096 if device.type == "cuda" else 256  # small on CPU, where fp16 may lack fast kernels
    try:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        reps, elapsed, best = 1, 0.0, 0.0
        # Doubling the repetitions doubles as warm-up. The best rate of the runs long enough to time
        # is kept: on a shared machine the slow runs measure the neighbours, not the device.
        while elapsed < budget_s / 2 and reps <= 2**16:
            reps *= 2
            start = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s / 16:
                best = max(best, 2 * n**3 * reps / elapsed / 1e12)
    except RuntimeError:  # the dtype has no matmul kernel on this device
        return None
    return round(best, 4)


def format_device_report(report: dict[str, Any]) -> str:
    """Render :func:`device_report`'s dict as readable text.

    Example:
        >>> print(format_device_report(device_report(measure=False)).splitlines()[0])
        amp_plugin doctor
    """
    keys = ("versions", "cpu", "cuda", "apex", "throughput_tflops", "recommended_precision", "reason")
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
        f"native bf16 instructions: {_yes(cpu['bf16_native'])}",
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
    for device, rates in (report["throughput_tflops"] or {}).items():
        shown = ", ".join(f"{k} {'-' if r is None else f'{r:.3g}'}" for k, r in rates.items())
        lines.append(f"  matmul       {device}: {shown} TFLOP/s")
    lines.append(f"  recommended  precision={report['recommended_precision']!r}: {report['reason']}")
    return "\n".join(lines)


def _yes(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")
