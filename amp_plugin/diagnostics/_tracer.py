"""The non-finite tracer: which module first produced inf/NaN, in forward or in backward.

Plain torch: nothing here imports Lightning; a detached tracer costs nothing.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import check_module
from amp_plugin.diagnostics._nonfinite import dtype_name, nonfinite_kind
from amp_plugin.numerics import FP16_MAX

__all__ = ["NonFiniteRecord", "NonFiniteTracer"]


@dataclass(frozen=True)
class NonFiniteRecord:
    """Where a :class:`NonFiniteTracer` first saw inf/NaN in one phase.

    ``origin`` is empty when ``module`` itself produced the values. Otherwise they reached
    ``module`` from elsewhere, and ``origin`` says from where: code between submodules in
    its parent's ``forward``, the loss, or the model's input. ``blame_cls`` is the class of
    the module whose code produced them (empty for the loss or the input).

    Example:
        >>> record = NonFiniteRecord("forward", "head", "Linear", "its output", "inf", torch.float16, 7e4)
        >>> print(record.message())
        head (Linear, float16) produced inf in forward (its output); largest finite |x| 7e+04 > 65504 ...
    """

    phase: Literal["forward", "backward"]
    module: str  # qualified name of the module ("<ClassName>" for the model itself)
    cls: str  # its class name
    what: str  # which tensor: "its output", "gradient w.r.t. its input", ...
    kind: str  # "inf", "nan" or "inf and nan"
    dtype: torch.dtype  # the dtype the module computed in
    largest_finite: float  # largest finite magnitude in that tensor; NaN when none is finite
    origin: str = ""
    blame_cls: str = ""

    def message(self) -> str:
        """One line: who produced what, in which dtype, and the largest finite magnitude seen."""
        where = f"{self.module} ({self.cls}, {dtype_name(self.dtype)})"
        if self.origin:
            head = f"{self.kind} in {self.phase} first reached {where} in {self.what}, from {self.origin}"
        else:
            head = f"{where} produced {self.kind} in {self.phase} ({self.what})"
        if math.isnan(self.largest_finite):
            return f"{head}; no finite values"
        tail = f"largest finite |x| {self.largest_finite:.3g}"
        if self.dtype == torch.float16:
            tail += " > 65504 (float16 max)" if self.largest_finite > FP16_MAX else " (float16 max 65504)"
        return f"{head}; {tail}"

    def hint(self) -> str:
        """The fix to try first, for this dtype and phase."""
        if self.origin == "the model's input":
            return "HINT: the batch already holds inf/NaN: check the data and its preprocessing."
        if self.dtype != torch.float16:
            return (
                f"HINT: {dtype_name(self.dtype)} has fp32's range, so reduced precision is not the cause: "
                "check the inputs, the learning rate and this module's math."
            )
        fp32 = "compute the loss in fp32"
        if self.blame_cls:
            fp32 = f"run {self.blame_cls} in fp32 (AMPPrecision(fp32_modules=({self.blame_cls},)))"
        if self.phase == "forward":
            return f"HINT: {fp32}, or use bf16 (precision='bf16-mixed', which has fp32's range)."
        return (
            "HINT: the loss scale is too high for these gradients: lower `init_scale` (e.g. "
            f"LossScaler(init_scale=2.0**10)); if it persists, {fp32} or use bf16."
        )


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _is_nonfinite(t: Tensor) -> bool:
    if not t.is_floating_point() or t.is_sparse or t.numel() == 0 or t.device.type == "meta":
        return False
    # One fused reduction in the common (finite) case; an fp32 overflow of the sum is confirmed exactly.
    return not bool(torch.isfinite(t.detach().sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all())


def _in_graph(t: Tensor) -> bool:
    # Hooks on non-leaf tensors die with their graph. A leaf (a parameter handed to a submodule or
    # returned by one) would keep every hook ever added; parameters have their own hook anyway.
    return t.requires_grad and t.grad_fn is not None


def _describe(t: Tensor) -> tuple[str, float]:
    """``(kind, largest finite |x|)``; the magnitude is NaN when no value is finite."""
    t = t.detach()
    finite = t.isfinite()
    largest = torch.where(finite, t.abs(), 0).max().float()
    stats = torch.stack([t.isinf().any(), t.isnan().any(), finite.any()]).float()
    has_inf, has_nan, any_finite = stats.tolist()
    return nonfinite_kind(bool(has_inf), bool(has_nan)), float(largest) if any_finite else math.nan


class NonFiniteTracer:
    """Record the first module, in execution order, whose output or gradient holds inf/NaN.

    While attached, every submodule has a forward pre-hook and a forward hook, and every
    parameter a gradient hook. The forward hook checks the module's outputs; tensor hooks on
    each module's inputs and outputs check gradients as backward reaches them. Tensor hooks,
    unlike ``register_full_backward_hook``, keep in-place modules (``ReLU(inplace=True)``)
    working. A module is blamed only when what it received was finite; otherwise the record
    says where the values came from (code between submodules, the loss, the input). A tensor
    read by several modules gets the sum of their gradients; the first reader is named.

    Each check is one fused reduction plus a host sync, so attach only while debugging. After
    the first record nothing is checked until :meth:`reset` (a forward record also explains
    the backward that follows). :meth:`detach` removes every hook; detached, it costs nothing.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 1), nn.ReLU())
        >>> _ = nn.init.constant_(model[0].weight, 3e38)  # 2 * 3e38 overflows float32
        >>> with NonFiniteTracer(model) as tracer:
        ...     _ = model(torch.ones(1, 2))
        >>> print(tracer.forward_record.message())
        0 (Linear, float32) produced inf in forward (its output); no finite values
    """

    def __init__(self, model: nn.Module) -> None:
        hint = "pass the model (e.g. the LightningModule), not its output or its parameters."
        check_module("NonFiniteTracer", "model", model, hint)  # untyped callers can pass anything
        self._model = model
        self._root = f"<{type(model).__name__}>"
        self._handles: list[RemovableHandle] = []
        self._lock = threading.Lock()
        self._records: dict[str, NonFiniteRecord] = {}
        self._dtypes: dict[str, torch.dtype] = {}  # compute dtype per module, from its last forward
        self._blamed: weakref.ref[Tensor] | None = None  # the gradient behind a "came from outside" record
        self._last: tuple[weakref.ref[Tensor], bool] | None = None  # one-entry cache of the last check
        self._classes: dict[str, str] = {}  # class name per module label

    @property
    def attached(self) -> bool:
        """``True`` between :meth:`attach` and :meth:`detach`."""
        return bool(self._handles)

    @property
    def forward_record(self) -> NonFiniteRecord | None:
        """The first non-finite output seen in forward since the last :meth:`reset`."""
        return self._records.get("forward")

    @property
    def backward_record(self) -> NonFiniteRecord | None:
        """The first non-finite gradient seen in backward since the last :meth:`reset`."""
        return self._records.get("backward")

    def report(self) -> str | None:
        """The message and hint of each record (forward first), or ``None`` when nothing was seen."""
        records = [r for r in (self.forward_record, self.backward_record) if r is not None]
        return "\n".join(f"{r.message()}\n  {r.hint()}" for r in records) or None

    def reset(self) -> None:
        """Forget the records, so that the next inf/NaN is recorded again."""
        with self._lock:
            self._records.clear()
            self._blamed = self._last = None

    def attach(self) -> NonFiniteTracer:
        """Install the hooks (again a no-op while attached); returns ``self``."""
        if self._handles:
            return self
        modules = dict(self._model.named_modules())
        self._classes = {name or self._root: type(module).__name__ for name, module in modules.items()}
        for name, module in modules.items():
            label = name or self._root
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._pre_hook, label), with_kwargs=True),
                module.register_forward_hook(functools.partial(self._post_hook, label), with_kwargs=True),
            ]
        for name, param in self._model.named_parameters():
            owner, _, pname = name.rpartition(".")
            if param.requires_grad:
                hook = functools.partial(
                    self._param_grad, owner or self._root, type(modules[owner]).__name__, pname
                )
                self._handles.append(param.register_hook(hook))
        return self

    def detach(self) -> None:
        """Remove every hook; tensor hooks still held by a pending graph turn into no-ops."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> NonFiniteTracer:
        return self.attach()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach()

    def _nonfinite(self, t: Tensor) -> bool:
        # Consecutive hooks often see the same tensor (a module's output is the next one's input).
        last = self._last
        if last is not None and last[0]() is t:
            return last[1]
        result = _is_nonfinite(t)
        self._last = (weakref.ref(t), result)
        return result

    def _origin(self, label: str, when: str) -> tuple[str, str]:
        """Where values reaching ``label`` from outside came from, and the class whose code that is."""
        if label == self._root:
            return ("the model's input" if when == "before" else "the loss (code after the model)"), ""
        parent = label.rpartition(".")[0] or self._root
        return f"code in {parent} that runs {when} it", self._classes.get(parent, "")

    def _record(
        self,
        phase: Literal["forward", "backward"],
        label: str,
        cls: str,
        t: Tensor,
        what: str,
        origin: tuple[str, str] | None = None,
    ) -> None:
        kind, largest = _describe(t)
        dtype = self._dtypes.get(label, t.dtype) if phase == "backward" else t.dtype
        where, blame = origin or ("", cls)
        record = NonFiniteRecord(phase, label, cls, what, kind, dtype, largest, where, blame)
        with self._lock:
            self._records[phase] = record

    def _pre_hook(self, label: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._records or not torch.is_grad_enabled():
            return
        hook = functools.partial(self._input_grad, label, type(module).__name__)
        for t in _tensors((args, kwargs)):
            if _in_graph(t):
                t.register_hook(hook)

    def _post_hook(self, label: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        cls = type(module).__name__
        outputs = [t for t in _tensors(output) if t.is_floating_point()]
        if outputs:
            self._dtypes[label] = outputs[0].dtype
        if not self._records and (bad := next((t for t in outputs if self._nonfinite(t)), None)) is not None:
            inputs_bad = any(self._nonfinite(t) for t in _tensors((args, kwargs)))
            origin = self._origin(label, "before") if inputs_bad else None
            self._record("forward", label, cls, bad, "its input" if inputs_bad else "its output", origin)
        if not self._records and torch.is_grad_enabled():
            hook = functools.partial(self._output_grad, label, cls)
            for t in outputs:
                if _in_graph(t):
                    t.register_hook(hook)

    def _may_record_backward(self, grad: Tensor) -> bool:
        # A forward record explains every non-finite gradient after it. A record saying "it came from
        # outside" is refined by hooks that see the very same gradient later: an outer module that
        # returned the tensor, or the module that consumed it (and so produced its gradient).
        if not self._handles or "forward" in self._records:
            return False
        current = self._records.get("backward")
        if current is not None and not (
            current.origin and self._blamed is not None and self._blamed() is grad
        ):
            return False
        return self._nonfinite(grad)

    def _output_grad(self, label: str, cls: str, grad: Tensor) -> None:
        if self._may_record_backward(grad):
            self._record(
                "backward", label, cls, grad, "gradient w.r.t. its output", self._origin(label, "after")
            )
            self._blamed = weakref.ref(grad)

    def _input_grad(self, label: str, cls: str, grad: Tensor) -> None:
        if self._may_record_backward(grad):
            self._record("backward", label, cls, grad, "gradient w.r.t. its input")
            self._blamed = None

    def _param_grad(self, label: str, cls: str, pname: str, grad: Tensor) -> None:
        if self._may_record_backward(grad):
            self._record("backward", label, cls, grad, f"gradient of its parameter {pname!r}")
            self._blamed = None
