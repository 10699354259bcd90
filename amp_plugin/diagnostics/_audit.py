"""The model audit: fp16 hazards found without running the model, as :class:`Finding` objects.

:mod:`amp_plugin.diagnostics._optimizer_check` reports its findings the same way. Plain torch.
"""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from amp_plugin._validation import check_int, check_module
from amp_plugin.numerics import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL

__all__ = ["AuditReport", "Finding", "audit_model", "join_names"]

Severity = Literal["error", "warning", "info"]

_NATIVE_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
# A forward that upcasts by itself does its statistics in fp32 whatever autocast does.
_UPCASTS = re.compile(r"\.float\(\)|float32|torch\.float\b|\.double\(\)|autocast\(")
# Tokens that hold words, not code: comments, strings, and the text parts of f-strings (Python 3.12+).
_WORDS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
# Half of fp16's spacing (32) above its max: from here on a cast to fp16 rounds to inf, below to 65504.
_FP16_ROUNDS_TO_INF = FP16_MAX + 16


@dataclass(frozen=True)
class Finding:
    """One problem found by a check: ``severity`` ("error", "warning" or "info"), a stable
    ``code``, a ``message`` that says what, why and ``HINT:`` the fix, and ``where`` (names of
    the parameters, buffers or modules concerned).

    Example:
        >>> print(Finding("warning", "bce-loss", "BCELoss under autocast. HINT: use BCEWithLogitsLoss."))
        warning: BCELoss under autocast. HINT: use BCEWithLogitsLoss.
    """

    severity: Severity
    code: str
    message: str
    where: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "where": list(self.where),
        }


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit_model` found; ``ok`` when there is no error.

    Example:
        >>> report = audit_model(nn.Linear(3, 8))
        >>> report.ok, report.counts()
        (True, {'error': 0, 'warning': 0, 'info': 1})
    """

    model: str
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """``True`` when no finding is an error."""
        return all(f.severity != "error" for f in self.findings)

    def counts(self) -> dict[str, int]:
        """Number of findings per severity."""
        return {s: sum(f.severity == s for f in self.findings) for s in ("error", "warning", "info")}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: model, ok, counts, findings."""
        return {
            "model": self.model,
            "ok": self.ok,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
        }

    def format(self, width: int = 100) -> str:
        """A readable table: one row per finding (severity, code, where), the message wrapped below.

        ``width`` (an int >= 20) is the column at which messages wrap.
        """
        check_int("AuditReport.format", "width", width, low=20, hint="100 columns suits a terminal.")
        nouns = {"error": "error", "warning": "warning", "info": "info note"}
        counts = ", ".join(f"{n} {nouns[s]}{'' if n == 1 else 's'}" for s, n in self.counts().items())
        lines = [f"Audit of {self.model}: {counts}"]
        if not self.findings:
            return lines[0] + "\nNo fp16 hazards found."
        lines.append(f"{'SEVERITY':<8}  {'CODE':<20}  WHERE")
        for f in self.findings:
            lines.append(f"{f.severity:<8}  {f.code:<20}  {join_names(f.where, 3) or '-'}")
            lines += textwrap.wrap(f.message, width, initial_indent=" " * 10, subsequent_indent=" " * 10)
        return "\n".join(lines)


def join_names(names: Sequence[str], limit: int = 5) -> str:
    """``"a, b, c and 2 more"``: the first ``limit`` names, for a message.

    Example:
        >>> join_names(["a", "b", "c", "d", "e"], limit=3)
        'a, b, c and 2 more'
    """
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _label(name: str, module: nn.Module) -> str:
    return f"{name or '<model>'} ({type(module).__name__})"


def audit_model(model: nn.Module) -> AuditReport:
    """Audit a model for fp16 hazards; nothing is run through the model.

    Checks: layer sizes that miss tensor cores (info), normalization eps and hand-written
    norms (info/warning), losses that autocast refuses (warning), float16 parameters
    (warning), values outside fp16's range (warning) and NaN/inf parameters (error).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))
        >>> audit_model(model).findings
        ()
        >>> [f.code for f in audit_model(nn.Linear(3, 8)).findings]
        ['tensor-core-size']
    """
    check_module("audit_model", "model", model, hint="pass the model instance, e.g. audit_model(MyModel()).")
    findings: list[Finding] = []
    for name, module in model.named_modules():
        findings += [*_sizes(name, module), *_norm(name, module), *_losses(name, module)]
    findings += _values(model)
    order = {"error": 0, "warning": 1, "info": 2}
    return AuditReport(type(model).__name__, tuple(sorted(findings, key=lambda f: order[f.severity])))


def _sizes(name: str, module: nn.Module) -> Iterator[Finding]:
    if isinstance(module, nn.Linear):
        dims = {"in_features": module.in_features, "out_features": module.out_features}
    elif isinstance(module, nn.modules.conv._ConvNd) and module.groups == 1:
        dims = {"in_channels": module.in_channels, "out_channels": module.out_channels}
    elif isinstance(module, nn.Embedding):
        dims = {"num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
    else:
        return
    odd = {k: v for k, v in dims.items() if v % 8}
    if odd:
        pads = ", ".join(f"{k}={v} (pad to {-(-v // 8) * 8})" for k, v in odd.items())
        yield Finding(
            "info",
            "tensor-core-size",
            f"{_label(name, module)}: {pads} not a multiple of 8. fp16/bf16 tensor cores run matmuls and "
            "convolutions fastest when these sizes are multiples of 8; this layer may fall back to slower "
            "kernels. HINT: pad the size if this layer is large enough to matter.",
            (name,),
        )


def _norm(name: str, module: nn.Module) -> Iterator[Finding]:
    eps = getattr(module, "eps", None)
    eps = eps if isinstance(eps, float) else None
    if isinstance(module, _NATIVE_NORMS):
        if eps is not None and 0 < eps < FP16_MIN_SUBNORMAL:
            yield Finding(
                "info",
                "norm-eps",
                f"{_label(name, module)}: eps={eps:g} is below fp16's smallest subnormal (6e-8), so it would "
                "be 0 in fp16. torch's kernel adds eps in fp32 even for fp16 inputs, so this is safe under "
                "autocast and .half(); it matters only if this norm is re-implemented or exported to fp16.",
                (name,),
            )
        return
    if "Norm" not in type(module).__name__ or type(module).__module__.startswith("torch."):
        return
    try:
        upcasts = bool(_UPCASTS.search(_code_of(type(module).forward)))
    # No source (built in C, defined in a REPL) or none that tokenizes: assume the worst.
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        upcasts = False
    if upcasts:
        return
    yield Finding("warning", "custom-norm", _custom_norm_message(name, module, eps), (name,))


def _code_of(function: Any) -> str:
    """The source of ``function`` with its comments and strings (docstrings too) blanked out."""
    source = textwrap.dedent(inspect.getsource(function))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return tokenize.untokenize(t._replace(string="") if t.type in _WORDS else t for t in tokens)


def _custom_norm_message(name: str, module: nn.Module, eps: float | None) -> str:
    note = ""
    if eps is not None and 0 < eps < FP16_MIN_SUBNORMAL:
        note = f" Its eps={eps:g} is below fp16's smallest subnormal (6e-8) and is 0 when added in fp16."
    elif eps is not None and 0 < eps < FP16_MIN_NORMAL:
        rounded = float(torch.tensor(eps, dtype=torch.float16))
        note = f" Its eps={eps:g} is subnormal in fp16 (stored as {rounded:.4g}, fewer significant bits)."
    cls = type(module).__name__
    return (
        f"{_label(name, module)} is a hand-written normalization whose forward does not upcast. Autocast "
        "runs only the ops on its fp32 list in fp32 (on CUDA pow, rsqrt, sum, norm, layer_norm; not mean, "
        "var, std, sqrt or division; on CPU none of these), so its statistics may be computed in fp16 and "
        f"overflow (a variance above 65504) or lose eps.{note} HINT: add {cls} to "
        f"AMPPrecision(fp32_modules=({cls},)), or upcast in its forward (x.float())."
    )


def _losses(name: str, module: nn.Module) -> Iterator[Finding]:
    if type(module) is nn.BCELoss:
        yield Finding(
            "warning",
            "bce-loss",
            f"{_label(name, module)}: binary_cross_entropy is unsafe under autocast and raises on CUDA "
            "(log of fp16 probabilities). HINT: drop the final Sigmoid and use nn.BCEWithLogitsLoss, which "
            "autocast runs in fp32.",
            (name,),
        )


def _values(model: nn.Module) -> Iterator[Finding]:
    tensors: list[tuple[str, str, Tensor]] = [("parameter", n, p) for n, p in model.named_parameters()]
    tensors += [("buffer", n, b) for n, b in model.named_buffers()]
    half = [n for kind, n, t in tensors if kind == "parameter" and t.dtype == torch.float16]
    if half:
        yield Finding(
            "warning",
            "fp16-params",
            f"{len(half)} parameter(s) are stored in float16 ({join_names(half)}). Mixed precision keeps "
            "fp32 parameters and lets autocast cast per op; float16 parameters get float16 gradients, which "
            "overflow under loss scaling, and lose updates below their float16 spacing (torch's GradScaler "
            "refuses to unscale them). HINT: remove `.half()` / `.to(torch.float16)` from the model.",
            tuple(half),
        )
    for kind, name, t in tensors:
        if t.is_floating_point() and t.numel() and t.device.type != "meta":
            yield from _value_findings(kind, name, t)


def _value_findings(kind: str, name: str, t: Tensor) -> Iterator[Finding]:
    a = t.detach().abs().float()
    finite = a.isfinite()
    stats = torch.stack(
        [
            a.isnan().sum(),
            a.isinf().sum(),
            ((a >= _FP16_ROUNDS_TO_INF) & finite).sum(),
            ((a <= FP16_MIN_SUBNORMAL / 2) & (a > 0)).sum(),  # what fp16 rounds to 0 (2**-25 ties to 0)
            (a > 0).sum(),
        ]
    )
    n_nan, n_inf, n_over, n_under, n_nonzero = (int(v) for v in stats.tolist())
    if n_nan or (n_inf and kind == "parameter"):  # inf buffers are common on purpose (-inf masks)
        yield Finding(
            "error",
            "nonfinite-values",
            f"{kind} `{name}` already holds {n_nan} NaN and {n_inf} inf value(s) of {t.numel()}: training "
            "cannot recover from this. HINT: check its initialisation or the checkpoint it was loaded from.",
            (name,),
        )
    if n_over:
        largest = float(torch.where(finite, a, 0).max())
        yield Finding(
            "warning",
            "fp16-overflow",
            f"{kind} `{name}` holds {n_over} value(s) with |x| up to {largest:.3g} >= 65520: they become "
            "inf when cast to fp16 (by autocast for a matmul, or by .half()), whose largest value is 65504. "
            "HINT: use bf16, keep the tensor out of fp16 ops, or for a mask use amp_plugin.numerics.limits("
            "torch.float16).safe_mask_value (-16376), which stays finite when masks are added together.",
            (name,),
        )
    if n_under and n_under > 0.01 * n_nonzero:
        yield Finding(
            "warning",
            "fp16-underflow",
            f"{kind} `{name}`: {n_under} of its {n_nonzero} nonzero values have |x| <= 3e-8 and become 0 in "
            "fp16. HINT: rescale the tensor (fold the factor into a later op) or use bf16.",
            (name,),
        )
