"""Which dtype common ops run in under autocast on a device: probed by running them, not listed by hand.

Autocast keeps its op lists in C++, per device type, and the CPU and CUDA lists differ (softmax
runs in fp32 under CUDA autocast, in its input's dtype under CPU autocast). :func:`probe_autocast_ops`
runs each op of a fixed set on small inputs under ``torch.autocast`` twice, once with fp32 inputs
and once with inputs already in the autocast dtype, and sorts it by what came back:

* ``"lower precision"``: fp32 inputs came back in the autocast dtype (matmul-like ops);
* ``"fp32"``: lower-precision inputs came back in fp32 (the fp32 list: losses, norms, ...);
* ``"promote/unchanged"``: the output follows the inputs (autocast leaves the op alone, or
  promotes mixed inputs to the widest type).

Behind ``python -m amp_plugin doctor --ops``. Plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from amp_plugin._validation import fail
from amp_plugin.precision import check_device

__all__ = ["AutocastOps", "OpProbe", "format_autocast_ops", "probe_autocast_ops"]

Category = Literal["lower precision", "fp32", "promote/unchanged", "error"]


class _Inputs:
    """Makes the probe's inputs: uniform in [0.1, 1) (safe for log and sqrt), one dtype, one device."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._generator = torch.Generator().manual_seed(0)

    def __call__(self, *shape: int) -> Tensor:
        values = torch.rand(shape, generator=self._generator) * 0.9 + 0.1
        return values.to(self.device, self.dtype)

    def labels(self, n: int) -> Tensor:
        return torch.arange(n, device=self.device)


_OPS: dict[str, Callable[[_Inputs], Any]] = {
    "mm": lambda t: torch.mm(t(4, 4), t(4, 4)),
    "matmul": lambda t: torch.matmul(t(2, 4, 4), t(4, 4)),
    "bmm": lambda t: torch.bmm(t(2, 4, 4), t(2, 4, 4)),
    "addmm": lambda t: torch.addmm(t(4), t(4, 4), t(4, 4)),
    "linear": lambda t: F.linear(t(2, 4), t(3, 4), t(3)),
    "conv1d": lambda t: F.conv1d(t(1, 2, 8), t(3, 2, 3)),
    "conv2d": lambda t: F.conv2d(t(1, 2, 6, 6), t(3, 2, 3, 3)),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention((q := t(1, 2, 4, 8)), q, q),
    "softmax": lambda t: torch.softmax(t(2, 4), -1),
    "log_softmax": lambda t: torch.log_softmax(t(2, 4), -1),
    "layer_norm": lambda t: F.layer_norm(t(2, 4), (4,), t(4), t(4)),
    "group_norm": lambda t: F.group_norm(t(2, 4, 3), 2, t(4), t(4)),
    "batch_norm": lambda t: F.batch_norm(t(3, 4), None, None, t(4), t(4), training=True),
    "sum": lambda t: torch.sum(t(4, 4)),
    "mean": lambda t: torch.mean(t(4, 4)),
    "cumsum": lambda t: torch.cumsum(t(4, 4), 0),
    "norm": lambda t: torch.linalg.vector_norm(t(4, 4)),
    "exp": lambda t: torch.exp(t(4, 4)),
    "log": lambda t: torch.log(t(4, 4)),
    "pow": lambda t: torch.pow(t(4, 4), 2.0),
    "sqrt": lambda t: torch.sqrt(t(4, 4)),
    "cross_entropy": lambda t: F.cross_entropy(t(3, 4), t.labels(3)),
    "nll_loss": lambda t: F.nll_loss(t(3, 4), t.labels(3)),
    "mse_loss": lambda t: F.mse_loss(t(4), t(4)),
    "l1_loss": lambda t: F.l1_loss(t(4), t(4)),
    "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(t(4), t(4)),
    "sigmoid": lambda t: torch.sigmoid(t(4, 4)),
    "tanh": lambda t: torch.tanh(t(4, 4)),
    "relu": lambda t: torch.relu(t(4, 4)),
    "gelu": lambda t: F.gelu(t(4, 4)),
    "silu": lambda t: F.silu(t(4, 4)),
    "add": lambda t: torch.add(t(4, 4), t(4, 4)),
    "mul": lambda t: torch.mul(t(4, 4), t(4, 4)),
    "cat": lambda t: torch.cat([t(2, 4), t(2, 4)]),
    "stack": lambda t: torch.stack([t(2, 4), t(2, 4)]),
}


@dataclass(frozen=True)
class OpProbe:
    """What one op returned under autocast: from fp32 inputs, and from inputs in the autocast dtype.

    ``error`` holds ``"Type: message"`` when the op raised (then both dtypes are ``None``).

    Example:
        >>> row = OpProbe("mm", "lower precision", torch.bfloat16, torch.bfloat16)
        >>> row.category
        'lower precision'
    """

    op: str
    category: Category
    from_fp32: torch.dtype | None
    from_half: torch.dtype | None
    error: str | None = None


@dataclass(frozen=True)
class AutocastOps:
    """The probe of every op on one device type in one autocast dtype; made by :func:`probe_autocast_ops`.

    Example:
        >>> ops = probe_autocast_ops("cpu", torch.bfloat16)
        >>> [row.category for row in ops.rows if row.op in ("mm", "relu", "mse_loss")]
        ['lower precision', 'fp32', 'promote/unchanged']
    """

    device: str
    dtype: torch.dtype
    rows: tuple[OpProbe, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: dtypes as their names (``"bfloat16"``), ``None`` kept."""
        return {
            "device": self.device,
            "dtype": _name(self.dtype),
            "rows": [
                {
                    "op": r.op,
                    "category": r.category,
                    "from_fp32": _name(r.from_fp32),
                    "from_half": _name(r.from_half),
                    "error": r.error,
                }
                for r in self.rows
            ],
        }


def probe_autocast_ops(device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> AutocastOps:
    """Run each common op under ``torch.autocast(device, dtype)`` and record the dtypes it returned.

    Args:
        device: the device type to probe (``"cpu"``, ``"cuda"``, ...); it must be present.
        dtype: the autocast dtype, ``torch.bfloat16`` or ``torch.float16``; default bf16 on CPU,
            fp16 elsewhere (autocast's own defaults).

    Raises:
        ValueError: ``device`` has no autocast or is not present, or ``dtype`` is not a half type.
        TypeError: ``dtype`` is not a ``torch.dtype``.

    Example:
        >>> rows = {row.op: row for row in probe_autocast_ops("cpu", torch.float16).rows}
        >>> rows["linear"].from_fp32, rows["cross_entropy"].from_half
        (torch.float16, torch.float32)
    """
    device_type = check_device(device, "probe_autocast_ops")
    available = getattr(getattr(torch, device_type, None), "is_available", None)
    if device_type != "cpu" and available is not None and not available():
        fail(
            "probe_autocast_ops",
            passed=f"device={device_type!r} (not available here)",
            why=f"this machine has no {device_type} device",
            allowed="a device on this machine",
            hint="probe 'cpu', or run on a machine with that device.",
        )
    dtype = _check_dtype(device_type, dtype)
    rows = tuple(_probe(op, fn, device_type, dtype) for op, fn in _OPS.items())
    return AutocastOps(device_type, dtype, rows)


def _check_dtype(device_type: str, dtype: object) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device_type == "cpu" else torch.float16
    hint = "pass torch.bfloat16 or torch.float16."
    if not isinstance(dtype, torch.dtype):
        fail(
            "probe_autocast_ops",
            passed=f"dtype={dtype!r}",
            allowed="a torch.dtype",
            hint=hint,
            error=TypeError,
        )
    if dtype not in (torch.bfloat16, torch.float16):
        fail(
            "probe_autocast_ops",
            passed=f"dtype={dtype}",
            why="autocast runs only in float16 or bfloat16",
            allowed="an autocast dtype (bfloat16 or float16)",
            hint=hint,
        )
    return dtype


def _probe(op: str, fn: Callable[[_Inputs], Any], device: str, dtype: torch.dtype) -> OpProbe:
    try:
        with torch.no_grad(), torch.autocast(device, dtype=dtype):
            from_fp32 = fn(_Inputs(device, torch.float32)).dtype
            from_half = fn(_Inputs(device, dtype)).dtype
    except Exception as err:  # an op may lack a kernel for a dtype on a device: a finding, not a crash
        return OpProbe(op, "error", None, None, f"{type(err).__name__}: {err}")
    category: Category = "lower precision" if from_fp32 == dtype else "fp32"
    if category == "fp32" and from_half != torch.float32:
        category = "promote/unchanged"
    return OpProbe(op, category, from_fp32, from_half)


def format_autocast_ops(results: AutocastOps | Iterable[AutocastOps]) -> str:
    """A table: one row per op, one column per probe (device and dtype), each cell the category.

    Example:
        >>> print(format_autocast_ops(probe_autocast_ops("cpu")).splitlines()[2])
        op                                cpu bfloat16
    """
    probes = [results] if isinstance(results, AutocastOps) else list(results)
    if not probes or not all(isinstance(p, AutocastOps) for p in probes):
        fail(
            "format_autocast_ops",
            passed=f"results={results!r:.60}",
            allowed="an AutocastOps or a list of them",
            hint="pass what probe_autocast_ops() returns.",
            error=TypeError,
        )
    width = max(len(op) for p in probes for op in (r.op for r in p.rows)) + 2
    lines = [
        "autocast ops: what each op returns under torch.autocast on this machine (probed)",
        "  lower precision: casts to the autocast dtype; fp32: runs in fp32; "
        "promote/unchanged: follows its inputs",
        "op".ljust(width) + "  ".join(f"{p.device} {_name(p.dtype)}".ljust(18) for p in probes).rstrip(),
    ]
    cells = [{r.op: r.category for r in p.rows} for p in probes]
    for op in dict.fromkeys(r.op for p in probes for r in p.rows):
        lines.append(op.ljust(width) + "  ".join(c.get(op, "-").ljust(18) for c in cells).rstrip())
    errors = [f"  {p.device} {_name(p.dtype)} {r.op}: {r.error}" for p in probes for r in p.rows if r.error]
    return "\n".join(lines + (["errors:", *errors] if errors else []))


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
