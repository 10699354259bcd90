"""``LossScaler``: a drop-in for ``torch.amp.GradScaler`` that cannot silently collapse.

One class, as torch's ``GradScaler`` is: the policy lives here, the scale and its update
rule in :mod:`amp_plugin._scale_policy`, the arithmetic in :mod:`amp_plugin.kernels`, and the
clipping math in :mod:`amp_plugin._clipping` (pure functions, handed what they need). Per
optimizer the scaler runs torch's state machine (READY -> UNSCALED -> STEPPED, reset by
``update()``, in :class:`Iteration`) and tracks the factor the gradients in memory still
carry, so that clipping never acts on scaled values and can be folded into a fused
optimizer's step. With a static scale of 1 it is a guard: nothing is scaled, and the
gradients are only read.

Which changes to the gradients are checked for inf/NaN, and when, is in ``docs/scaler.md``.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor

from amp_plugin import _clipping as clipping
from amp_plugin import _distributed as distributed
from amp_plugin import _scaler_rules
from amp_plugin._optim import (
    GRAD_SCALER_KWARG_WARNING,
    gradients_to_unscale,
    step_with_amp_attributes,
    takes_grad_scaler,
    unwrap_optimizer,
)
from amp_plugin._scale_policy import DynamicScale
from amp_plugin._sharding import ShardAwareKernels, has_dtensor, local_shards
from amp_plugin._validation import check_bool, check_int, check_number, fail
from amp_plugin.kernels import Backend, get_kernels
from amp_plugin.spike import SpikeGuard, check_spike_guard

__all__ = ["LossScaler"]

T = TypeVar("T")


class Stage(enum.Enum):
    """Where an optimizer stands: gradients still scaled, unscaled (or clipped), or stepped."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


StageName = Literal["ready", "unscaled", "stepped"]
_STAGE_NAMES: dict[Stage, StageName] = {
    Stage.READY: "ready",
    Stage.UNSCALED: "unscaled",
    Stage.STEPPED: "stepped",
}


@dataclass
class OptimizerState:
    """One optimizer's part of the iteration."""

    stage: Stage = Stage.READY
    found_inf: Tensor | None = None
    grad_scale: Tensor | None = None  # the factor the grads still carry once stage is UNSCALED
    synced: bool = False  # found_inf already agreed across ranks (all-reduced, or from a global norm)
    skipped: bool | None = None  # found_inf as read on the host by a non-fused step(), else None
    skip: Tensor | None = None  # the step's skip flag where a spike guard widened found_inf, else None

    def merge_inf(self, flag: Tensor, agreed: bool) -> None:
        """Fold a later inf check (``flag`` > 0: overflow) into this optimizer's flag.

        ``agreed``: ``flag`` is the same on every rank already (it came from a global norm).
        """
        if self.found_inf is None or self.stage is Stage.READY:
            self.found_inf, self.synced = flag, agreed
            return
        torch.maximum(self.found_inf, flag.to(self.found_inf), out=self.found_inf)
        self.synced = self.synced and agreed


class Iteration:
    """The states of the optimizers touched since the last ``update()``.

    Example:
        >>> it = Iteration()
        >>> it.open(1).stage = Stage.UNSCALED
        >>> it.stage(1), it.stage(2), it.in_flight()
        (<Stage.UNSCALED: 1>, <Stage.READY: 0>, True)
    """

    def __init__(self) -> None:
        self.states: dict[int, OptimizerState] = {}
        self.retired: list[Tensor] = []  # inf flags of steps taken before an optimizer was re-armed
        self.scaled = False  # scale() ran since the last update(): gradients in flight carry the scale

    def get(self, key: int) -> OptimizerState | None:
        """The state of the optimizer with ``id`` ``key``, if it was touched."""
        return self.states.get(key)

    def open(self, key: int) -> OptimizerState:
        """The state of the optimizer with ``id`` ``key``, created READY on first touch."""
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = OptimizerState()
        return state

    def stage(self, key: int) -> Stage:
        """Where that optimizer stands (READY when untouched)."""
        state = self.states.get(key)
        return Stage.READY if state is None else state.stage

    def in_flight(self) -> bool:
        """Whether anything happened since the last ``update()``: the gradients carry the scale."""
        return self.scaled or bool(self.states) or bool(self.retired)

    def flags(self, agree: Callable[[OptimizerState], None]) -> list[Tensor]:
        """Every inf flag of the iteration, each agreed across ranks first (``agree``)."""
        for state in self.states.values():  # unscaled or clipped but never stepped: agree on it here
            agree(state)
        return [s.found_inf for s in self.states.values() if s.found_inf is not None] + self.retired

    def skipped_on_host(self) -> bool | None:
        """Whether any step of the iteration was skipped, if every step read its flag; else ``None``."""
        if self.retired or not self.states:
            return None
        skipped = False
        for state in self.states.values():
            if state.skipped is None:
                return None
            skipped = skipped or state.skipped
        return skipped

    def rearm(self, key: int, agree: Callable[[OptimizerState], None]) -> None:
        """Let that optimizer run READY -> STEPPED again; its flag so far still counts for ``update()``."""
        state = self.states.pop(key, None)
        if state is not None and state.found_inf is not None:
            agree(state)
            self.retired.append(state.found_inf)

    def forget(self, key: int) -> None:
        """Drop that optimizer's state: its gradients will not be stepped."""
        self.states.pop(key, None)

    def clear(self) -> None:
        """Start the next iteration."""
        self.states.clear()
        self.retired.clear()
        self.scaled = False


class LossScaler:
    """Dynamic loss scaling with hysteresis, scale bounds and static mode.

    Takes ``torch.amp.GradScaler``'s arguments in its order. With ``hysteresis=1``, no
    bounds and ``dynamic=True`` it takes exactly GradScaler's steps, bit for bit, while
    the scale stays a normal fp32 number. It never lets the scale go below ``min_scale``,
    or below 2**-126 without one (where GradScaler's scale would go on to 0 and turn the
    gradients into NaN); a scale stuck at that floor is reported once with a
    :class:`~amp_plugin._scale_policy.ScaleFloorWarning`.

    Args:
        device: the device type the scale lives on. ``None`` (the default): wherever the
            first scaled loss is. ``"cuda"`` without CUDA disables the scaler with a
            warning, as GradScaler does.
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale when it backs off, in (0, 1).
        growth_interval: clean steps in a row before the scale grows (>= 1).
        enabled: ``False`` makes every method a pass-through.
        hysteresis: overflowing steps in a row (without a clean step between) before the
            scale backs off: the h-th and every one after it back off; each of them is skipped.
            A clean step refills the budget.
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this.
        dynamic: ``False`` keeps the scale at ``init_scale`` (static loss scaling);
            overflowing steps are still skipped.
        kernels: ``"auto"``, ``"torch"`` or ``"apex"`` (needs NVIDIA Apex ``amp_C``).
        sync_found_inf: all-reduce the inf flag across ranks before each skip decision:
            ``"auto"`` (when torch.distributed runs with several processes), True or False.
        process_group: the ranks that must agree (``None``: the default group).
        spike_guard: a :class:`~amp_plugin.spike.SpikeGuard` that also skips a step whose loss
            (or gradient norm, with ``on=``) jumps far above its history. Such a skip is counted in
            ``skipped_steps`` but is no overflow: the scale does not back off. Its history is part of
            :meth:`state_dict`. ``None`` (the default): no spike check.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler("cpu", init_scale=2.0**10)
        >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.skipped_steps, scaler.total_steps
        (1024.0, 0, 1)
    """

    def __init__(
        self,
        device: str | None = None,
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
        spike_guard: SpikeGuard | None = None,
    ) -> None:
        device_type = _scaler_rules.check_device(device)
        self.spike_guard = check_spike_guard("LossScaler", spike_guard)
        enabled = check_bool("LossScaler", "enabled", enabled)
        policy = DynamicScale(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
            dynamic,
        )
        self._kernels_name = _scaler_rules.check_kernels(kernels)
        self._sync_mode = distributed.check_sync_mode(sync_found_inf)
        self.process_group = distributed.check_process_group(process_group, "LossScaler")
        if device_type == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(
                "LossScaler('cuda') is enabled, but CUDA is not available. Disabling: losses are not "
                "scaled and steps are not checked. HINT: pass the device you train on, e.g. "
                "LossScaler('cpu'), or leave device=None (wherever the first loss is).",
                stacklevel=2,
            )
            enabled = False
        self._enabled = enabled
        self._policy = policy
        self._kernels: ShardAwareKernels | None = None
        self._one: tuple[Tensor, Tensor] | None = None  # (the scale, a 1 beside it): the inf check's factor
        self._iteration = Iteration()
        self._guard_only = _guard_only(policy)
        self._last_skipped: bool | None = None  # last_step_skipped, where update() knew it on the host

    @classmethod
    def from_grad_scaler(cls, grad_scaler: Any, **options: Any) -> LossScaler:
        """A ``LossScaler`` with a ``torch.amp.GradScaler``'s settings and state.

        ``options`` are this class's keyword-only extras (``hysteresis``, ``min_scale``, ...).

        Example:
            >>> scaler = LossScaler.from_grad_scaler(torch.amp.GradScaler("cpu", init_scale=512.0))
            >>> scaler.get_scale(), scaler.get_growth_interval()
            (512.0, 2000)
        """
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            fail(
                "LossScaler.from_grad_scaler",
                passed=f"{type(grad_scaler).__qualname__}",
                allowed="a torch.amp.GradScaler",
                hint="pass the GradScaler itself.",
                error=TypeError,
            )
        taken = sorted(set(options) & {"device", "init_scale", "growth_factor", "backoff_factor",
                                       "growth_interval", "enabled"})  # fmt: skip
        if taken:
            fail(
                "LossScaler.from_grad_scaler",
                passed=", ".join(f"{name}={options[name]!r}" for name in taken),
                why="these settings come from the GradScaler",
                allowed="this class's keyword-only extras (hysteresis, min_scale, max_scale, dynamic, ...)",
                hint="set them on the GradScaler before converting it, or build LossScaler(...) directly.",
                error=TypeError,
            )
        device = getattr(grad_scaler, "_device", None)
        if not grad_scaler.is_enabled():
            warnings.warn(
                "The torch.amp.GradScaler is disabled, so its LossScaler is too: fp16 gradients will not be "
                "scaled. HINT: pass a GradScaler for the device you train on (e.g. GradScaler('cpu')).",
                stacklevel=2,
            )
            return cls(device if device != "cuda" else None, enabled=False, **options)
        if getattr(grad_scaler, "_per_optimizer_states", None):
            fail(
                "LossScaler.from_grad_scaler",
                passed="a GradScaler in the middle of an iteration",
                why="the GradScaler is between scale() and update()",
                allowed="one between update() and the next scale()",
                hint="convert it after update().",
                error=RuntimeError,
            )
        state = grad_scaler.state_dict()
        scaler = cls(
            device,
            state["scale"],
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
            **options,
        )
        scaler.load_state_dict(state)
        return scaler

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
        fail(
            "LossScaler.scale",
            passed=f"outputs={type(outputs).__qualname__}",
            allowed="a tensor or a list/tuple of tensors",
            hint="scale the loss tensor before calling backward().",
            error=TypeError,
        )

    def _begin(self, loss: Tensor) -> Tensor:
        """The scale, on ``loss``'s device, for a loss that backward will start from.

        A refused ``sync_found_inf=True`` is refused here, before anything of the iteration
        happened; the spike guard sees the loss.
        """
        if self._sync_mode is True:
            distributed.checked_sync_enabled(True, self.process_group)
        scale = self._policy.ensure(loss.device)
        self._iteration.scaled = True
        if self.spike_guard is not None:
            self.spike_guard.observe(loss)
        return scale if scale.device == loss.device else scale.to(loss.device, non_blocking=True)

    def _scale_tensor(self, loss: Tensor) -> Tensor:
        scale = self._begin(loss)
        if self._guard_only:  # a scale of 1 scales nothing: the loss keeps its dtype and values
            return _ScaledLoss.apply(loss) if loss.requires_grad else loss
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        # Type promotion gives the product the loss's dtype (fp64 stays fp64, integers become fp32,
        # as torch's do).
        if not loss.requires_grad:
            return loss * scale
        # A non-finite loss can have finite gradients (a NaN from a term no parameter is in), and its
        # step must be skipped all the same: backward multiplies by the seed, scale + 0 * loss, the
        # scale itself (bit for bit torch's GradScaler's gradients) for a finite loss, NaN for an
        # inf/NaN one, which the step's inf check then finds. In C++: no Python runs in backward.
        return loss * _seed(scale, loss)

    def backward_seed(self, loss: Tensor) -> Tensor:
        """The gradient to start backward from: ``loss.backward(gradient=scaler.backward_seed(loss))``.

        The parameters get the gradients of ``scale(loss).backward()``, bit for bit, in one launch
        where that takes four for a loss scaler (the factor ``scale + 0 * loss``, its product with
        the loss, the ones autograd starts from and the product's backward) and two for a guard.
        The seed is the scale, in ``loss``'s shape, and NaN where ``loss`` is inf/NaN, so that the
        step is skipped (1 for a guard, ones for a disabled scaler). For a one-element
        floating-point loss, the loss ``backward()`` takes without a ``gradient``.
        """
        if not isinstance(loss, Tensor) or not loss.is_floating_point():
            fail(
                "LossScaler.backward_seed",
                passed=f"loss={type(loss).__qualname__}"
                + (f" of dtype={loss.dtype}" if isinstance(loss, Tensor) else ""),
                allowed="a floating-point tensor of one element",
                hint="pass the loss you would call backward() on; for another, use scale(loss).backward().",
                error=TypeError,
            )
        if loss.numel() != 1:
            fail(
                "LossScaler.backward_seed",
                passed=f"loss=Tensor of shape {tuple(loss.shape)}",
                why="backward() starts only from a loss of one element without a gradient",
                allowed="a loss of one element",
                hint="reduce the loss first, or call scale(loss).backward(gradient) with your gradient.",
            )
        if not self._enabled:
            return torch.ones_like(loss)
        return _seed(self._begin(loss), loss)

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place and record inf/NaN.

        Call at most once per optimizer between ``update()`` calls, before ``step()``.
        Sparse gradients are unscaled through their values, as torch does.
        """
        if not self._enabled:
            return
        opt = unwrap_optimizer(optimizer)
        state = self._state(opt, "unscale_")
        if state.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "(clip_grad_norm_ and clip_grad_value_ unscale too.) HINT: unscale once per "
                "iteration, after all backward passes, then step() and update()."
            )
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). HINT: unscale (or clip) before step(); "
                "call update() to start the next iteration."
            )
        scale = self._require_scale("unscale_")
        if self._guard_only:  # a scale of 1: the gradients are read, never written
            state.found_inf = self._nonfinite(gradients_to_unscale(opt), self._carried_factor(opt))
        else:
            # torch's GradScaler takes the reciprocal in fp64 and rounds it to fp32; one fp32 reciprocal
            # gives the same bits, in one launch where that takes three: a quotient correctly rounded
            # to 53 bits, then to 24, is the quotient correctly rounded to 24 (53 >= 2 * 24 + 2).
            inv_scale = scale.reciprocal()
            state.found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
            self._backend().unscale_(gradients_to_unscale(opt), inv_scale, state.found_inf)
        state.stage, state.grad_scale = Stage.UNSCALED, None

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless a gradient is inf/NaN.

        Optimizers with ``_step_supports_amp_scaling`` (torch's fused Adam/AdamW/SGD) get
        ``grad_scale``/``found_inf`` attributes and skip inside their kernel; their step
        counters do not advance on a skip. A ``grad_scale`` set on the optimizer beforehand
        is multiplied in (kept as it is after an explicit ``unscale_``), as torch does. An
        optimizer whose ``step()`` takes ``grad_scaler=`` gets this scaler instead (with
        torch's ``FutureWarning``). Returns ``None`` for a skipped non-fused step.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled. (Nor with a "
                "LossScaler: the closure's backward would not be scaled.) HINT: run the closure "
                "(forward + scaled backward) yourself, then call step()."
            )
        opt = unwrap_optimizer(optimizer)
        state = self._state(opt, "step")
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). (Once per optimizer "
                "and iteration.) HINT: call update() once per iteration, after the step() of "
                "every optimizer."
            )
        if _fused(opt):
            return self._fused_step(opt, optimizer, state, *args, **kwargs)
        # A spike guard's norm needs dense gradients: refused (TypeError) before anything is unscaled.
        spike = self.spike_guard
        grads = clipping.gradients(opt.param_groups) if spike is not None and spike.wants_grad_norm else None
        if state.stage is Stage.READY:
            self.unscale_(opt)
        found_inf = cast(Tensor, state.found_inf)
        self._sync(state)
        skip = self._with_spike(opt, state, found_inf, grads)
        state.skipped = bool(skip.item())  # the one host read of this step, kept for every reader
        result = None if state.skipped else optimizer.step(*args, **kwargs)
        state.stage = Stage.STEPPED
        return result

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale once per iteration, after the ``step()`` of every optimizer.

        Does not synchronise the host, except once every 100 updates to look for a scale
        stuck at its floor. ``new_scale`` sets the scale by hand instead; it must be a
        finite number within ``[min_scale, max_scale]`` (read once on the host).
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        policy = self._policy
        if new_scale is not None:
            value = _scaler_rules.check_manual_scale(
                new_scale, scale.device, policy.min_scale, policy.max_scale
            )
            # An iteration that checked gradients is counted (skipped or not); the scale is the one given.
            found = self._iteration.flags(self._sync)
            self._last_skipped = self._iteration.skipped_on_host() if found else None
            if found:
                policy.count_(_combined(found), self._last_skipped)
            policy.set_(value)
            self._guard_only = self._guard_only and float(value) == 1.0
            if self.spike_guard is not None:
                self.spike_guard.discard()
            self._end_iteration()
            return
        found = self._iteration.flags(self._sync)
        if not found:
            raise RuntimeError(
                "No inf checks were recorded prior to update. (No optimizer's gradients were "
                "checked for inf/NaN since the last update().) HINT: " + _ORDER
            )
        self._last_skipped = self._iteration.skipped_on_host()  # known without a read where step() read
        # Only a spike flag that a step() of this iteration applied is counted (made there, once).
        guard = self.spike_guard
        spike = guard.flag() if guard is not None and guard.flag_made else None
        found_inf = _combined(found)  # read only below, and the iteration's flags are dropped with it
        self._end_iteration()
        # A spike skips and is counted, but is no overflow: only found_inf moves the scale.
        skipped = None if spike is None else found_inf + spike.to(found_inf.device)
        policy.update_(found_inf, self._last_skipped, skipped)
        if self.spike_guard is not None:
            flag = found_inf if skipped is None else skipped
            self.spike_guard.commit(self._last_skipped if self._last_skipped is not None else flag)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); synchronises the host."""
        return self._policy.value() if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    # -- GradScaler's getters and setters ----------------------------------------------------

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a finite number > 1), effective from the next ``update()``."""
        self._policy.growth_factor = check_number(
            "LossScaler.set_growth_factor",
            "new_factor",
            new_factor,
            low=1.0,
            low_open=True,
            hint="2.0 doubles the scale.",
        )

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by on overflow."""
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)), effective from the next ``update()``."""
        self._policy.backoff_factor = check_number(
            "LossScaler.set_backoff_factor",
            "new_factor",
            new_factor,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            hint="0.5 halves the scale on overflow.",
        )

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1), effective from the next ``update()``."""
        call = "LossScaler.set_growth_interval"
        self._policy.growth_interval = check_int(
            call, "new_interval", new_interval, low=1, hint="2000 is torch's default."
        )

    # this scaler's own settings and counts, read-only
    hysteresis = property(lambda self: self._policy.hysteresis, doc="Overflows in a row before a backoff.")
    min_scale = property(lambda self: self._policy.min_scale, doc="The lowest scale (None: 2**-126).")
    max_scale = property(lambda self: self._policy.max_scale, doc="The highest scale (None: unbounded).")
    dynamic = property(lambda self: self._policy.dynamic, doc="False: static loss scaling.")
    total_steps = property(lambda self: self._policy.total_steps, doc="Iterations closed by update().")

    # -- clipping and checks on the unscaled gradients -------------------------------------

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
        ``torch.nn.utils.clip_grad_norm_`` up to fp32 rounding. A non-finite norm marks the
        step as overflowing, also after an explicit ``unscale_``. With ``sharded=True`` the
        optimizer holds only this rank's shard of the gradients, and the norm is that of
        all shards across ``process_group`` (one extra collective of one element).
        ``DTensor`` gradients (``fully_shard``) need no flag: their norm is always global.
        """
        call = "LossScaler.clip_grad_norm_"
        max_norm = check_number(call, "max_norm", max_norm, low=0.0, hint="e.g. max_norm=1.0.")
        norm_type = _scaler_rules.check_norm_type(call, norm_type)
        error_if_nonfinite = check_bool(call, "error_if_nonfinite", error_if_nonfinite)
        sharded = check_bool(call, "sharded", sharded)
        opt = unwrap_optimizer(optimizer)
        grads = clipping.gradients(opt.param_groups)
        if sharded and has_dtensor(grads):
            fail(
                call,
                passed="sharded=True",
                why="DTensor gradients carry their sharding, and their norm is global already",
                allowed="sharded=False when the gradients are DTensors (fully_shard)",
                hint=(
                    "DTensor gradients carry their sharding and their norm is already global; "
                    "sharded=True is for plain tensors that hold one rank's shard (FSDP1, ZeRO)."
                ),
            )
        kernels = self._backend()
        if sharded:  # plain tensors holding this rank's shard: the norm is reduced over the group
            kernels = ShardAwareKernels(kernels.inner, sharded=True, group=self.process_group)
        if not self._enabled:
            return clipping.clip_grad_norm_(kernels, grads, max_norm, norm_type).total_norm
        state = self._clippable_state(opt, call)
        ready = state.stage is Stage.READY
        carried = self._carried_factor(opt) if ready else state.grad_scale
        # Fold only while the gradients still carry a factor: once unscaled in memory, the
        # in-place multiply is torch's own recipe (bit for bit, but where torch rounds the factor:
        # kernels.base).
        fold = carried is not None and _fused(opt)
        result = clipping.clip_grad_norm_(
            kernels,
            grads,
            max_norm,
            norm_type,
            grad_scale=carried,
            fold=fold,
            error_if_nonfinite=error_if_nonfinite,
        )
        state.merge_inf(result.found_inf, agreed=sharded)  # a global norm is agreed already
        state.stage, state.grad_scale = Stage.UNSCALED, result.grad_scale
        if self.spike_guard is not None:
            self.spike_guard.observe_grad_norm(result.total_norm)  # the norm before clipping
        return result.total_norm

    def grad_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The total norm of the optimizer's unscaled gradients, leaving them as they are (one read)."""
        norm_type = _scaler_rules.check_norm_type("LossScaler.grad_norm", norm_type)
        opt = unwrap_optimizer(optimizer)
        norm = self._backend().norm(clipping.gradients(opt.param_groups), norm_type)
        state = self._iteration.get(id(opt))
        if not self._enabled or self._policy.scale is None:
            return norm
        carried = (
            self._carried_factor(opt) if state is None or state.stage is Stage.READY else state.grad_scale
        )
        return norm if carried is None else norm / carried.to(norm)

    def clip_grad_value_(self, optimizer: Any, clip_value: float) -> None:
        """Clamp every unscaled gradient element to ``[-clip_value, clip_value]``.

        Gradients unscaled earlier are checked again first (one read): the clamp would turn an inf
        that a hook or penalty wrote since ``unscale_`` into ``clip_value`` and hide it.
        """
        clip_value = check_number(
            "LossScaler.clip_grad_value_", "clip_value", clip_value, low=0.0, hint="e.g. clip_value=0.5."
        )
        opt = unwrap_optimizer(optimizer)
        grads = clipping.gradients(opt.param_groups)  # refuses sparse gradients
        if self._enabled:
            state = self._clippable_state(opt, "LossScaler.clip_grad_value_")
            if state.stage is Stage.READY:
                self.unscale_(opt)
            elif state.grad_scale is not None:  # a folded norm clip: materialise it first
                self._backend().mul_(grads, state.grad_scale.reciprocal())
                state.grad_scale = None
            elif state.found_inf is not None:
                self._recheck(state, grads)
        clipping.clamp_(local_shards(grads), clip_value)

    def _clippable_state(self, opt: Any, call: str) -> OptimizerState:
        state = self._state(opt, call)
        if state.stage is Stage.STEPPED:
            raise RuntimeError(
                f"{call}() was called after step() on this optimizer. HINT: clip before step()."
            )
        return state

    def _carried_factor(self, opt: Any) -> Tensor | None:
        """What still-scaled gradients carry: the scale, times a fused optimizer's preset ``grad_scale``.

        ``None`` for a guard (a static scale of 1) without a preset: nothing to divide by.
        """
        scale = self._require_scale("clip")
        preset = getattr(opt, "grad_scale", None) if _fused(opt) else None
        if self._guard_only:
            return preset
        return scale if preset is None else scale * preset

    def recheck_(self, optimizer: Any) -> None:
        """Mark the step as overflowing if an unscaled gradient of ``optimizer`` is now inf/NaN.

        For changes made after ``unscale_`` or a clip (hooks, penalties): one read of the
        gradients (their norm), no write; on a CPU, gradients this scaler unscaled in place (up to
        8M elements) are checked by torch's AMP check instead, one launch that multiplies them by 1
        and leaves their values as they are. Before ``unscale_`` there is nothing to do (``step``
        checks the gradients then). The flag is agreed across ranks again before the step.
        """
        if not self._enabled:
            return
        self._require_scale("recheck_")
        opt = unwrap_optimizer(optimizer)
        state = self._iteration.get(id(opt))
        if state is None or state.stage is Stage.READY:
            return
        if state.stage is Stage.STEPPED or state.found_inf is None:
            raise RuntimeError(
                "recheck_() was called after step() on this optimizer. HINT: recheck before step()."
            )
        self._recheck(state, gradients_to_unscale(opt))

    def _recheck(self, state: OptimizerState, grads: list[Tensor]) -> None:
        """:meth:`recheck_` of ``grads``, for an optimizer whose ``state`` has a flag and has not stepped."""
        flag = cast(Tensor, state.found_inf)
        if flag.device != self._require_scale("recheck_").device or flag.dtype != torch.float32:
            state.merge_inf(self._nonfinite(grads, state.grad_scale), agreed=False)
            return
        # Set in the step's own flag (two launches fewer than a new flag and a maximum of the two).
        # Unscaled in place already (by a loss scaler: a guard and a folded clip only read them).
        rewrite = not self._guard_only and state.grad_scale is None
        self._nonfinite(grads, state.grad_scale, into=flag, rewrite=rewrite)
        state.synced = False  # this rank's view changed: agree across ranks again before the step

    # -- what happened this iteration ------------------------------------------------------

    def stage(self, optimizer: Any) -> StageName:
        """Where ``optimizer`` stands in this iteration: gradients still scaled, unscaled, or stepped."""
        return _STAGE_NAMES[self._iteration.stage(id(unwrap_optimizer(optimizer)))]

    def found_inf(self, optimizer: Any) -> Tensor | None:
        """The inf flag of ``optimizer`` in this iteration (0-dim fp32; > 0: its step is skipped).

        ``None`` until its gradients were checked (by ``unscale_``, a clip or ``step``).
        """
        state = self._iteration.get(id(unwrap_optimizer(optimizer)))
        return None if state is None else state.found_inf

    @property
    def skipped_steps(self) -> int:
        """How many iterations had an inf/NaN gradient (their steps were skipped)."""
        return self._policy.skipped_steps()

    @property
    def skipped_steps_seen(self) -> int:
        """:attr:`skipped_steps` as last known on the host, without a read.

        Exact while every step read its inf flag (non-fused optimizers); with fused ones it lags
        until the next read (of ``skipped_steps``, or the check every 100 updates).
        """
        return self._policy.skipped_seen

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last ``update()`` was skipped.

        No host read where every ``step()`` of that iteration already read its flag (non-fused
        optimizers); otherwise one.
        """
        if self._last_skipped is not None:
            return self._last_skipped
        return self._policy.last_skipped()

    @property
    def is_guard(self) -> bool:
        """Whether this scaler only guards: a static scale of 1, nothing scaled, gradients only read.

        Example:
            >>> LossScaler(init_scale=1.0, dynamic=False).is_guard, LossScaler().is_guard
            (True, False)
        """
        return self._guard_only

    @property
    def warn_on_skips(self) -> bool:
        """Whether the scaler warns by itself (once each) about a floored scale and long runs of skips.

        The warnings are :class:`~amp_plugin._scale_policy.ScaleFloorWarning` and
        :class:`~amp_plugin._scale_policy.SkipStreakWarning`.

        ``True`` by default; ``LossScaleMonitor`` turns it off while it reports these itself.
        """
        return self._policy.report

    @warn_on_skips.setter
    def warn_on_skips(self, value: bool) -> None:
        self._policy.report = check_bool("LossScaler", "warn_on_skips", value)

    # -- checkpoints and pickling ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys plus this scaler's own. Empty when disabled.

        With a spike guard, its history too, under ``"spike_guard"`` (:meth:`SpikeGuard.state_dict`).
        """
        if not self._enabled:
            return {}
        state = self._policy.state_dict()
        if self.spike_guard is not None:
            state["spike_guard"] = self.spike_guard.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        The whole dict is validated before anything changes. Refused in the middle of an
        iteration (after ``scale()``, before ``update()``): the gradients in flight carry
        the old scale. A spike guard's history loads into this scaler's spike guard; without
        one it is not wanted and is left out; a state without one leaves the guard's history as it is.
        """
        if self._enabled:
            self._require_between_iterations(
                "load_state_dict", "load the state before scale() or after update()."
            )
            self.check_state_dict(state_dict)
            spike = state_dict.get("spike_guard") if isinstance(state_dict, dict) else None
            self._policy.load_state_dict(_without_spike(state_dict))
            if spike is not None and self.spike_guard is not None:
                self.spike_guard.load_state_dict(spike)
            self._guard_only = _guard_only(self._policy)
            self._last_skipped = None

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state_dict``; change nothing."""
        policy = self._policy
        _scaler_rules.checked_state(
            _without_spike(state_dict), policy.hysteresis, policy.min_scale, policy.max_scale
        )
        spike = state_dict.get("spike_guard") if isinstance(state_dict, dict) else None
        if spike is not None and self.spike_guard is not None:
            self.spike_guard.check_state_dict(spike)

    def __getstate__(self) -> dict[str, Any]:
        # As torch's: refused once an optimizer was unscaled or stepped (a scaled loss alone is fine).
        if self._enabled and (self._iteration.states or self._iteration.retired):
            raise RuntimeError(
                "LossScaler pickling is refused in the middle of an iteration (unscale_ or step happened "
                "since the last update()): its per-optimizer state would be lost. HINT: pickle (or "
                "deepcopy) the scaler after update()."
            )
        return {**self.__dict__, "_kernels": None, "_one": None}

    def step_skipped(self, optimizer: Any) -> bool | Tensor | None:
        """Whether ``optimizer``'s step in this iteration was skipped, as known without a new host read.

        A ``bool`` where :meth:`step` already read the inf flag (non-fused optimizers), the flag
        itself (a 0-dim tensor, > 0: skipped) where the step stayed on the device (fused
        optimizers), ``None`` when the optimizer has not been checked in this iteration.
        """
        state = self._iteration.get(id(unwrap_optimizer(optimizer)))
        if state is None:
            return None
        if state.skipped is not None:
            return state.skipped
        return state.skip if state.skip is not None else state.found_inf

    # -- internals ---------------------------------------------------------------------------

    def _backend(self) -> ShardAwareKernels:
        if self._kernels is None:
            scale = self._policy.scale
            kernels = get_kernels(self._kernels_name, None if scale is None else scale.device)
            self._kernels = ShardAwareKernels(kernels)  # DTensor gradients: local shards, global norms
        return self._kernels

    def _nonfinite(
        self, grads: list[Tensor], carried: Tensor | None, into: Tensor | None = None, rewrite: bool = False
    ) -> Tensor:
        """This rank's inf flag of ``grads`` (one read, three launches), next to the scale.

        Where the spike guard wants this iteration's gradient norm, the same per-tensor norms give
        it (two launches more, no read of the gradients), divided by the factor ``carried``.
        ``rewrite``: the gradients were written already (unscaled), and where
        :func:`clipping.rewrite_pays` they are checked by the backend's unscale with a factor of 1
        (one launch that leaves every value as it was) instead.
        """
        scale = self._require_scale("the inf check")
        if self._one is None or self._one[0] is not scale:  # made once per scale tensor
            self._one = (scale, torch.ones((), dtype=torch.float32, device=scale.device))
        one = self._one[1]
        spike = self.spike_guard
        want = spike is not None and spike.wants_grad_norm
        shards = local_shards(grads)
        if rewrite and into is not None and not want and clipping.rewrite_pays(shards, into):
            try:
                self._backend().inner.unscale_(shards, one, into)  # local shards already
                return into
            except RuntimeError:  # a gradient that cannot be written (an expanded view): the norms read it
                pass
        found_inf, norm = clipping.nonfinite_and_norm(shards, one, want, into)
        if spike is not None and norm is not None:
            spike.observe_grad_norm(norm if carried is None else norm / carried.to(norm))
        return found_inf

    def _require_scale(self, call: str) -> Tensor:
        if self._policy.scale is None:
            raise RuntimeError(f"{call}() was called before scale(). HINT: " + _ORDER)
        return self._policy.scale

    def _require_between_iterations(self, what: str, hint: str) -> None:
        if self._iteration.in_flight():
            raise RuntimeError(
                f"LossScaler {what} is refused in the middle of an iteration (scale() or unscale_/step "
                f"happened since the last update()): the gradients in flight carry this scale. HINT: {hint}"
            )

    def _state(self, opt: Any, call: str) -> OptimizerState:
        self._require_scale(call)
        return self._iteration.open(id(opt))

    def _sync(self, state: OptimizerState) -> None:
        if state.synced or state.found_inf is None:
            return
        if distributed.checked_sync_enabled(self._sync_mode, self.process_group):  # checked in __init__
            distributed.all_reduce_found_inf(state.found_inf, self.process_group)
        state.synced = True

    def _fused_step(self, opt: Any, optimizer: Any, state: OptimizerState, *args: Any, **kwargs: Any) -> Any:
        if takes_grad_scaler(opt):  # the optimizer asks this scaler for what it needs (torch's old contract)
            warnings.warn(GRAD_SCALER_KWARG_WARNING, FutureWarning, stacklevel=3)
            try:  # the optimizer may call unscale_ on this scaler from inside its step
                return optimizer.step(*args, **kwargs, grad_scaler=self)
            finally:
                state.stage = Stage.STEPPED
        if state.stage is Stage.READY:
            # The optimizer divides by the scale itself; it only needs the inf flag (one read-only pass).
            grad_scale: Tensor | None = self._carried_factor(opt)
            state.found_inf = self._nonfinite(clipping.gradients(opt.param_groups), grad_scale)
        else:  # unscaled: a folded clip factor, or the user's own preset (kept, as torch keeps it)
            grad_scale = (
                state.grad_scale if state.grad_scale is not None else getattr(opt, "grad_scale", None)
            )
        self._sync(state)
        state.stage = Stage.STEPPED
        skip = self._with_spike(opt, state, cast(Tensor, state.found_inf))
        return step_with_amp_attributes(opt, optimizer, grad_scale, skip, *args, **kwargs)

    def _with_spike(
        self, opt: Any, state: OptimizerState, found_inf: Tensor, grads: list[Tensor] | None = None
    ) -> Tensor:
        """The step's skip flag: ``found_inf``, OR-ed with the iteration's spike flag (on the device).

        The spike guard's values are agreed across ranks (MAX) where ``found_inf`` is, once per
        iteration, so every rank keeps the same history and skips together. A gradient norm the
        step did not compute (a loss-scaled, non-fused step without a norm clip) costs one read here.
        """
        spike = self.spike_guard
        if spike is None:
            return found_inf
        if spike.wants_grad_norm:
            grads = clipping.gradients(opt.param_groups) if grads is None else grads
            norm = self._backend().norm(grads)
            spike.observe_grad_norm(norm if state.grad_scale is None else norm / state.grad_scale.to(norm))
        agree = None
        if distributed.checked_sync_enabled(self._sync_mode, self.process_group):
            agree = functools.partial(distributed.all_reduce_max_, group=self.process_group)
        flag = spike.flag(agree)
        if flag is None:
            return found_inf
        state.skip = torch.maximum(found_inf, flag.to(found_inf.device))
        return state.skip

    def _end_iteration(self) -> None:
        self._iteration.clear()

    # -- used by AMPPrecision for Lightning's control flow -----------------------------------

    def rearm(self, optimizer: Any) -> None:
        """Let ``optimizer`` be unscaled and stepped again before ``update()``; keep its inf flag.

        For manual optimization that steps one optimizer twice in an iteration (a WGAN critic),
        after another backward: the next ``update()`` still counts the first step's overflow.
        """
        self._iteration.rearm(id(unwrap_optimizer(optimizer)), self._sync)

    def forget(self, optimizer: Any) -> None:
        """Drop this iteration's state of ``optimizer``: its gradients will not be stepped.

        For a batch whose optimizer step does not happen (``training_step`` returned ``None``):
        nothing of it carries into the next iteration's check.
        """
        self._iteration.forget(id(unwrap_optimizer(optimizer)))


class _ScaledLoss(torch.autograd.Function):
    """A guard's "scaled" loss: a view of ``loss`` whose backward is NaN for an inf/NaN loss.

    A non-finite loss can have finite gradients (a NaN from a term no parameter is in), and its
    step must be skipped all the same. So backward sends on ``grad + 0 * loss``: ``grad`` itself
    for a finite loss, NaN otherwise, which the guard's check then finds. No launch forward (a
    view) and one backward, where the C++ product a loss scaler uses (see ``_scale_tensor``)
    takes three. Differentiable again (``create_graph``).
    """

    @staticmethod
    def forward(ctx: Any, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (loss,) = ctx.saved_tensors
        return torch.add(grad, loss, alpha=0)


def _seed(scale: Tensor, loss: Tensor) -> Tensor:
    """``scale + 0 * loss``: the scale for a finite loss, NaN for an inf/NaN one; no autograd history.

    One launch (in a fit a detach costs less than turning grad mode off and on). A half loss gets
    it in its own dtype, written by the add itself: an fp32 sum would cost autograd a cast to the
    loss's dtype (with the same rounding).
    """
    loss = loss.detach()
    if loss.dtype in (torch.float16, torch.bfloat16):
        return torch.add(scale, loss, alpha=0, out=torch.empty_like(loss))
    return torch.add(scale, loss, alpha=0)


def _combined(flags: list[Tensor]) -> Tensor:
    """One inf flag for the iteration (> 0: some optimizer's step was skipped); one tensor as it is."""
    if len(flags) == 1:
        return flags[0]
    total = flags[0].clone()
    for other in flags[1:]:
        total += other.to(total.device)
    return total


def _fused(opt: Any) -> bool:
    """:func:`~amp_plugin._optim.handles_unscaling` for an optimizer that is unwrapped already."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def _without_spike(state_dict: Any) -> Any:
    """``state_dict`` without a spike guard's history (the scale policy's part), as it is otherwise."""
    if isinstance(state_dict, dict) and "spike_guard" in state_dict:
        return {k: v for k, v in state_dict.items() if k != "spike_guard"}
    return state_dict


def _guard_only(policy: DynamicScale) -> bool:
    """A static scale of 1: nothing is scaled; the scaler only checks and skips (the bf16/fp32 guard)."""
    return not policy.dynamic and policy.init_scale == 1.0


_ORDER = "per iteration: scale(loss).backward(), optionally unscale_/clip, step(optimizer), update()."
