"""``LossScaler``: a drop-in for ``torch.amp.GradScaler`` that cannot silently collapse.

Policy lives here; the arithmetic goes to :mod:`amp_plugin.kernels`. Per optimizer the
scaler runs torch's state machine (READY -> UNSCALED -> STEPPED, reset by ``update()``)
and tracks the factor the gradients in memory still carry, so that clipping never acts
on scaled values and can be folded into a fused optimizer's step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor

from amp_plugin import clipping, distributed
from amp_plugin.kernels import Backend, Kernels, check_backend, get_kernels

__all__ = ["LossScaler", "unwrap_optimizer"]

T = TypeVar("T")
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_OWN_KEYS = (
    "hysteresis",
    "_hysteresis_tracker",
    "min_scale",
    "max_scale",
    "dynamic",
    "skipped_steps",
    "total_steps",
)


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf: Tensor | None = None
    grad_scale: Tensor | None = None  # factor the grads still carry once stage is UNSCALED
    synced: bool = False  # found_inf already agreed across ranks (all-reduced, or from a global norm)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer behind wrappers that hold it in ``._optimizer`` / ``.optimizer``.

    Lightning's ``LightningOptimizer`` is itself an ``Optimizer`` subclass, so the unwrap
    follows the attributes rather than stopping at the first ``Optimizer``.
    """
    for _ in range(16):
        inner = getattr(optimizer, "_optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"Expected a torch.optim.Optimizer (or a wrapper holding one in .optimizer/._optimizer), got "
            f"{type(optimizer).__qualname__}. HINT: pass the optimizer that owns the parameters."
        )
    return optimizer


class LossScaler:
    """Dynamic loss scaling with hysteresis, scale bounds and static mode.

    With ``hysteresis=1``, no bounds and ``dynamic=True`` it takes exactly the steps of
    ``torch.amp.GradScaler`` with the same arguments, bit for bit.

    Args:
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale when it backs off, in (0, 1).
        growth_interval: clean steps in a row before the scale grows (>= 1).
        enabled: ``False`` makes every method a pass-through.
        hysteresis: overflowing steps in a row (without a clean step between) before the
            scale backs off; each of them is skipped. A clean step refills the budget.
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this.
        dynamic: ``False`` keeps the scale at ``init_scale`` (static loss scaling);
            overflowing steps are still skipped.
        kernels: ``"auto"``, ``"torch"`` or ``"apex"``.
        sync_found_inf: all-reduce the inf flag across ranks before each skip decision:
            ``"auto"`` (when torch.distributed runs with several processes), True or False.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler(init_scale=2.0**10)
        >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.skipped_steps, scaler.total_steps
        (1024.0, 0, 1)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        kernels: Backend = "auto",
        sync_found_inf: distributed.SyncMode = "auto",
        process_group: Any = None,
    ) -> None:
        _validate(
            init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        self._kernels_name = check_backend(kernels)
        self._sync_mode = distributed.check_sync_mode(sync_found_inf)
        self.process_group = process_group
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.dynamic = bool(dynamic)
        self.total_steps = 0
        self._init_trackers = (0, self.hysteresis, 0)  # growth, hysteresis, skipped: used before lazy init
        self._scale: Tensor | None = None
        self._growth_tracker = self._hysteresis_tracker = self._skipped = self._last_inf = torch.zeros(())
        self._kernels: Kernels | None = None
        self._states: dict[int, _OptimizerState] = {}

    # -- the GradScaler API --------------------------------------------------------------

    def scale(self, outputs: T) -> T:
        """Multiply ``outputs`` (a tensor or nested lists/tuples of them) by the scale.

        Half-precision outputs are upcast to fp32 first: a non-scalar fp16 loss times 2**16
        would overflow in fp16 (torch's GradScaler keeps it in fp16).
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return cast(T, self._scale_tensor(outputs))
        if isinstance(outputs, (list, tuple)):
            return cast(T, type(outputs)(self.scale(o) for o in outputs))
        raise TypeError(
            f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__qualname__}. "
            "HINT: scale the loss tensor before calling backward()."
        )

    def _scale_tensor(self, loss: Tensor) -> Tensor:
        if self._scale is None:
            self._lazy_init(loss.device)
        assert self._scale is not None
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self._scale.to(loss.device, non_blocking=True)

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place and record inf/NaN.

        Call at most once per optimizer between ``update()`` calls, before ``step()``.
        """
        if not self._enabled:
            return
        opt = unwrap_optimizer(optimizer)
        state = self._state(opt, "unscale_")
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update() "
                "(clip_grad_norm_ and clip_grad_value_ unscale too). HINT: unscale once per "
                "iteration, after all backward passes, then step() and update()."
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() on this optimizer. HINT: unscale (or clip) "
                "before step(); call update() to start the next iteration."
            )
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()
        state.found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        self._backend().unscale_(clipping.gradients(opt.param_groups), inv_scale, state.found_inf)
        state.stage, state.grad_scale = _Stage.UNSCALED, None

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient is inf/NaN.

        Optimizers with ``_step_supports_amp_scaling`` (torch's fused Adam/AdamW/SGD) get
        ``grad_scale``/``found_inf`` attributes and skip inside their kernel; their step
        counters do not advance on a skip. Returns ``None`` for a skipped non-fused step.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "step(optimizer, closure=...) is not supported while loss scaling is enabled. "
                "HINT: run the closure (forward + scaled backward) yourself, then call step()."
            )
        opt = unwrap_optimizer(optimizer)
        state = self._state(opt, "step")
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called on this optimizer since the last update(). "
                "HINT: call update() once per iteration, after the step() of every optimizer."
            )
        if getattr(opt, "_step_supports_amp_scaling", False):
            return self._fused_step(opt, optimizer, state, *args, **kwargs)
        if state.stage is _Stage.READY:
            self.unscale_(opt)
        assert state.found_inf is not None
        self._sync(state)
        result = None if state.found_inf.item() else optimizer.step(*args, **kwargs)
        state.stage = _Stage.STEPPED
        return result

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale once per iteration, after the ``step()`` of every optimizer.

        Does not synchronise the host: the scale and all trackers stay on the device.
        """
        if not self._enabled:
            return
        if self._scale is None:
            raise RuntimeError("update() was called before scale(). HINT: " + _ORDER)
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                self._scale.copy_(new_scale)
            else:
                self._scale.fill_(float(new_scale))
            self._states.clear()
            return
        for state in self._states.values():  # unscaled or clipped, never stepped: agree on it here
            self._sync(state)
        found = [s.found_inf for s in self._states.values() if s.found_inf is not None]
        if not found:
            raise RuntimeError(
                "update() was called but no optimizer's gradients were checked for inf/NaN since the "
                "last update(). HINT: " + _ORDER
            )
        found_inf = found[0].clone()
        for other in found[1:]:
            found_inf += other.to(found_inf.device)
        if self.dynamic:
            self._update_scale(found_inf)
        self._last_inf.copy_(found_inf > 0)
        self._skipped += self._last_inf
        self.total_steps += 1
        self._states.clear()

    def stage(self, optimizer: Any) -> Literal["ready", "unscaled", "stepped"]:
        """Where ``optimizer`` stands in this iteration: gradients still scaled, unscaled, or stepped."""
        state = self._states.get(id(unwrap_optimizer(optimizer)))
        stage = _Stage.READY if state is None else state.stage
        return cast(Literal["ready", "unscaled", "stepped"], stage.name.lower())

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); synchronises the host."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    @property
    def growth_factor(self) -> float:
        return self._growth_factor

    @property
    def backoff_factor(self) -> float:
        return self._backoff_factor

    @property
    def growth_interval(self) -> int:
        return self._growth_interval

    @property
    def skipped_steps(self) -> int:
        """How many iterations had an inf/NaN gradient (their steps were skipped)."""
        return self._init_trackers[2] if self._scale is None else int(self._skipped.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last ``update()`` was skipped."""
        return self._scale is not None and bool(self._last_inf.item())

    # -- clipping on unscaled gradients ----------------------------------------------------

    def clip_grad_norm_(
        self,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        sharded: bool = False,
    ) -> Tensor:
        """Clip the optimizer's gradients by their unscaled total norm; return that norm.

        Before ``unscale_`` the norm and the inf check come from one read of the scaled
        gradients, then one multiply applies ``clip_coef / scale`` (for a fused optimizer
        the factor goes into its ``grad_scale`` instead). Equal to ``unscale_`` followed by
        ``torch.nn.utils.clip_grad_norm_`` up to fp32 rounding. With ``sharded=True`` the
        optimizer holds only this rank's shard of the gradients, and the norm is that of
        all shards across ``process_group`` (one extra collective of one element).
        """
        opt = unwrap_optimizer(optimizer)
        grads = clipping.gradients(opt.param_groups)
        kernels = distributed.GlobalNormKernels(self._backend(), self.process_group) if sharded else None
        if not self._enabled:
            return clipping.clip_grad_norm_(kernels or self._backend(), grads, max_norm, norm_type).total_norm
        state = self._clippable_state(opt, "clip_grad_norm_")
        carried = self._scale if state.stage is _Stage.READY else state.grad_scale
        # Fold only while the gradients still carry a factor: once unscaled in memory, the
        # in-place multiply is torch's own recipe, bit for bit.
        fold = carried is not None and bool(getattr(opt, "_step_supports_amp_scaling", False))
        result = clipping.clip_grad_norm_(
            kernels or self._backend(), grads, max_norm, norm_type,
            grad_scale=carried, fold=fold, error_if_nonfinite=error_if_nonfinite,
        )  # fmt: skip
        if state.stage is _Stage.READY:
            state.found_inf, state.synced = result.found_inf, sharded  # a global norm is agreed already
        state.stage, state.grad_scale = _Stage.UNSCALED, result.grad_scale
        return result.total_norm

    def grad_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The total norm of the optimizer's unscaled gradients, leaving them as they are (one read)."""
        opt = unwrap_optimizer(optimizer)
        norm = self._backend().norm(clipping.gradients(opt.param_groups), norm_type)
        state = self._states.get(id(opt))
        carried = self._scale if state is None or state.stage is _Stage.READY else state.grad_scale
        return norm if carried is None or not self._enabled else norm / carried.to(norm)

    def clip_grad_value_(self, optimizer: Any, clip_value: float) -> None:
        """Clamp every unscaled gradient element to ``[-clip_value, clip_value]``."""
        opt = unwrap_optimizer(optimizer)
        if self._enabled:
            state = self._clippable_state(opt, "clip_grad_value_")
            if state.stage is _Stage.READY:
                self.unscale_(opt)
            elif state.grad_scale is not None:  # a folded norm clip: materialise it first
                self._backend().mul_(clipping.gradients(opt.param_groups), state.grad_scale.reciprocal())
                state.grad_scale = None
        torch.nn.utils.clip_grad_value_(
            [p for g in opt.param_groups for p in g["params"] if p.grad is not None], clip_value
        )

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys plus this scaler's own. Empty when disabled."""
        if not self._enabled:
            return {}
        growth, hyst, skipped = self._trackers()
        return {
            "scale": self.get_scale(), "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
            "_growth_tracker": growth, "hysteresis": self.hysteresis, "_hysteresis_tracker": hyst,
            "min_scale": self.min_scale, "max_scale": self.max_scale, "dynamic": self.dynamic,
            "skipped_steps": skipped, "total_steps": self.total_steps,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        The whole dict is validated before anything changes.
        """
        if not self._enabled:
            return
        sd = _validated_state(state_dict)
        _validate(sd["scale"], sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"],
                  sd.get("hysteresis", self.hysteresis), sd.get("min_scale", self.min_scale),
                  sd.get("max_scale", self.max_scale))  # fmt: skip
        self._init_scale = float(sd["scale"])
        self._growth_factor, self._backoff_factor = float(sd["growth_factor"]), float(sd["backoff_factor"])
        self._growth_interval = int(sd["growth_interval"])
        self.hysteresis = int(sd.get("hysteresis", self.hysteresis))
        self.min_scale, self.max_scale = (
            sd.get("min_scale", self.min_scale),
            sd.get("max_scale", self.max_scale),
        )
        self.dynamic = bool(sd.get("dynamic", self.dynamic))
        self.total_steps = int(sd.get("total_steps", 0))
        self._init_trackers = (
            int(sd["_growth_tracker"]),
            int(sd.get("_hysteresis_tracker", self.hysteresis)),
            int(sd.get("skipped_steps", 0)),
        )
        if self._scale is not None:
            self._lazy_init(self._scale.device)

    # -- internals ---------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        growth, hyst, skipped = self._init_trackers
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), growth, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((), hyst, dtype=torch.int32, device=device)
        self._skipped = torch.full((), skipped, dtype=torch.int64, device=device)
        self._last_inf = torch.zeros((), dtype=torch.bool, device=device)

    def _trackers(self) -> tuple[int, int, int]:
        if self._scale is None:
            return self._init_trackers
        return (
            int(self._growth_tracker.item()),
            int(self._hysteresis_tracker.item()),
            int(self._skipped.item()),
        )

    def _backend(self) -> Kernels:
        if self._kernels is None:
            self._kernels = get_kernels(
                self._kernels_name, None if self._scale is None else self._scale.device
            )
        return self._kernels

    def _state(self, opt: Any, call: str) -> _OptimizerState:
        if self._scale is None:
            raise RuntimeError(f"{call}() was called before scale(). HINT: " + _ORDER)
        return self._states.setdefault(id(opt), _OptimizerState())

    def _clippable_state(self, opt: Any, call: str) -> _OptimizerState:
        state = self._state(opt, call)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                f"{call}() was called after step() on this optimizer. HINT: clip before step()."
            )
        return state

    def _sync(self, state: _OptimizerState) -> None:
        if state.synced or state.found_inf is None:
            return
        if distributed.sync_enabled(self._sync_mode, self.process_group):
            distributed.all_reduce_found_inf(state.found_inf, self.process_group)
        state.synced = True

    def _fused_step(self, opt: Any, optimizer: Any, state: _OptimizerState, *args: Any, **kwargs: Any) -> Any:
        assert self._scale is not None
        if state.stage is _Stage.READY:
            state.found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
            self._backend().unscale_(
                clipping.gradients(opt.param_groups), torch.ones_like(self._scale), state.found_inf
            )
            grad_scale: Tensor | None = self._scale * getattr(opt, "grad_scale", 1)
        else:
            grad_scale = state.grad_scale
        assert state.found_inf is not None
        self._sync(state)
        opt.grad_scale, opt.found_inf = grad_scale, state.found_inf
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del opt.grad_scale, opt.found_inf
            state.stage = _Stage.STEPPED

    def _update_scale(self, found_inf: Tensor) -> None:
        scale, growth = self._scale, self._growth_tracker
        assert scale is not None
        args = (self._growth_factor, self._backoff_factor, self._growth_interval)
        if self.hysteresis == 1:
            torch._amp_update_scale_(scale, growth, found_inf, *args)
        else:
            overflow = found_inf > 0
            self._hysteresis_tracker.copy_(
                torch.where(overflow, self._hysteresis_tracker - 1, torch.full_like(growth, self.hysteresis))
            )
            backoff = overflow & (self._hysteresis_tracker <= 0)
            before = scale.clone()
            torch._amp_update_scale_(scale, growth, backoff.float(), *args)
            held = overflow & ~backoff  # absorbed by hysteresis: skip, keep the scale, restart growth
            scale.copy_(torch.where(held, before, scale))
            growth.masked_fill_(held, 0)
        if self.min_scale is not None or self.max_scale is not None:
            scale.clamp_(self.min_scale, self.max_scale)


_ORDER = "per iteration: scale(loss).backward(), optionally unscale_/clip, step(optimizer), update()."


def _validate(
    init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
    hysteresis: Any, min_scale: Any, max_scale: Any,
) -> None:  # fmt: skip
    """Check every argument first, so that a bad one leaves nothing half-applied."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    low = min_scale if number(min_scale) else 0.0
    high = max_scale if number(max_scale) else math.inf
    rules = [
        (number(init_scale) and init_scale > 0, f"init_scale={init_scale!r}", "a finite number > 0",
         "2.0**16 is the usual start for fp16."),
        (number(growth_factor) and growth_factor > 1, f"growth_factor={growth_factor!r}",
         "a finite number > 1", "2.0 doubles the scale after growth_interval clean steps."),
        (number(backoff_factor) and 0 < backoff_factor < 1, f"backoff_factor={backoff_factor!r}",
         "a number in (0, 1)", "0.5 halves the scale on overflow."),
        (count(growth_interval), f"growth_interval={growth_interval!r}", "an int >= 1",
         "2000 is torch's default."),
        (count(hysteresis), f"hysteresis={hysteresis!r}", "an int >= 1",
         "1 backs off on every overflow (torch's behaviour); 2 tolerates one overflow in a row."),
        (min_scale is None or (number(min_scale) and min_scale > 0), f"min_scale={min_scale!r}",
         "None or a finite number > 0", "e.g. min_scale=1.0 keeps the scale from collapsing towards 0."),
        (max_scale is None or (number(max_scale) and max_scale > 0), f"max_scale={max_scale!r}",
         "None or a finite number > 0", "e.g. max_scale=2.0**24."),
        (low <= high, f"min_scale={min_scale!r}, max_scale={max_scale!r}", "min_scale <= max_scale",
         "swap the two bounds."),
        (not number(init_scale) or low <= init_scale <= high, f"init_scale={init_scale!r}",
         f"a scale within [{low}, {high}]", "pick init_scale between min_scale and max_scale."),
    ]  # fmt: skip
    for ok, what, allowed, hint in rules:
        if not ok:
            raise ValueError(f"LossScaler({what}) is not allowed: {allowed}. HINT: {hint}")


def _validated_state(state_dict: Any) -> dict[str, Any]:
    what = "LossScaler.load_state_dict"
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError(
            f"{what} got {type(state_dict).__qualname__} {state_dict!r:.80}; expected the non-empty dict "
            "from LossScaler.state_dict() or torch.amp.GradScaler.state_dict(). HINT: an empty dict comes "
            "from a disabled scaler (e.g. a bf16 run); do not load it into an fp16 scaler."
        )
    missing = [k for k in _TORCH_KEYS if k not in state_dict]
    unknown = sorted(set(state_dict) - set(_TORCH_KEYS) - set(_OWN_KEYS))
    if missing or unknown:
        raise ValueError(
            f"{what}: not a loss-scaler state (missing keys {missing}, unknown keys {unknown}); expected "
            f"the keys {list(_TORCH_KEYS)} and optionally {list(_OWN_KEYS)}. HINT: pass the dict saved by "
            "LossScaler.state_dict() or torch.amp.GradScaler.state_dict(), not another object's state."
        )
    for key in ("_growth_tracker", "_hysteresis_tracker", "skipped_steps", "total_steps"):
        value = state_dict.get(key, 0)
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or (value < 0 and key != "_hysteresis_tracker")
        ):
            raise ValueError(
                f"{what}: {key}={value!r} must be a non-negative int. HINT: the state is corrupt."
            )
    if not isinstance(state_dict.get("dynamic", True), bool):
        raise ValueError(
            f"{what}: dynamic={state_dict['dynamic']!r} must be a bool. HINT: the state is corrupt."
        )
    return state_dict
