"""One training run's mixed precision, in plain torch: the arguments checked once, the guard built once.

The Trainer's :class:`~amp_plugin.AMPPrecision`, Fabric's :class:`~amp_plugin.lightning.fabric.AMPPrecision`
and anything else that drives a training loop take the same arguments: ``precision``, ``device``
and ``scaler`` (positional, as in Lightning's ``MixedPrecision``) and the keywords of
:class:`RunOptions`. Each adapter hands them to one :class:`AMPRun`, which

- checks every argument before it builds anything (what was passed, what is allowed, ``HINT:``);
- resolves the precision (``"auto"`` picks bf16 where the device has it) and builds the fp16 loss
  scaler, or for the other precisions a guard that scales nothing and checks every step;
- owns the half-precision weights (master weights, ``"-true"`` roundings, fp32 gradient
  accumulation), the fp32 functions, the fp8 request and the :class:`~amp_plugin._step.StepDriver`;
- gives the forward passes their context (autocast, the ``"-true"`` default dtype, the fp32
  functions).

The adapters keep only what their framework calls: which hook runs what. Nothing here imports
Lightning; what an adapter wants said on rank zero it passes down as ``say``.
"""

from __future__ import annotations

import difflib
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal, TypedDict

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from amp_plugin import fp8 as fp8_layers
from amp_plugin import fp32_policy
from amp_plugin import precision as precisions
from amp_plugin._distributed import is_rank_zero
from amp_plugin._fit_start import LBFGS_UNGUARDED, check_fit_start, is_lbfgs, module_device
from amp_plugin._half_weights import HalfWeights
from amp_plugin._metrics import amp_metrics
from amp_plugin._scaler import LossScaler
from amp_plugin._step import StepDriver
from amp_plugin._validation import check_bool, check_choice, check_int, fail
from amp_plugin.fp8 import Float8, Float8Report, Recipe, check_fp8_request
from amp_plugin.kernels import Backend, check_backend
from amp_plugin.master_weights import MasterWeights, check_master_weights
from amp_plugin.precision import Precision, check_precision, default_dtype, true_dtype
from amp_plugin.rounded_updates import ROUNDINGS
from amp_plugin.spike import SpikeGuard, check_spike_guard

__all__ = [
    "STATE_EXTRAS",
    "AMPRun",
    "RunOptions",
    "assigned_scaler",
    "guard_of",
    "load_run_state",
    "load_scaler_state",
    "run_state",
]

STATE_EXTRAS = ("guard", "rounding")
"""The keys of :meth:`AMPRun.state_dict` beside the loss scaler's own: the guard's state, the rounding's."""

Say = Callable[[str, bool], None]
"""Says a message on rank zero: ``say(message, warn)``, a warning if ``warn``, else information."""


class RunOptions(TypedDict, total=False):
    """The keyword arguments every ``AMPPrecision`` takes (Trainer and Fabric alike), with their meaning.

    - ``kernels``: the kernel backend of the default scaler, the guard and clipping: ``"auto"``
      (Apex's ``amp_C`` where installed, else torch), ``"torch"`` or ``"apex"``. Default ``"auto"``.
    - ``fp32_modules``: module classes whose forward runs in fp32 with autocast off. Default ``()``.
    - ``fp32_functions``: torch functions (``torch.sigmoid``, ``torch.Tensor.softmax``,
      ``F.gelu``) whose calls in forward passes run in fp32 with autocast off (Apex's
      ``register_float_function``); see :class:`~amp_plugin.fp32_policy.Fp32Functions`. Default ``()``.
    - ``clip_fused``: ``"auto"`` takes the fast clipping path (norm and inf check on the
      still-scaled gradients, one combined multiply or a fold into a fused optimizer) unless a hook
      could look at the gradients between backward and step; ``True`` always takes it (such hooks
      then see scaled gradients); ``False`` unscales before the hooks, as Lightning does. Fabric
      has no such hooks: ``fabric.clip_gradients`` unscales first, whatever this says. Default
      ``"auto"``.
    - ``lr_on_skip``: ``"hold"`` keeps a step-interval LR scheduler still when its optimizer's
      step was skipped; ``"advance"`` steps it anyway, without PyTorch's misleading order warning.
      Default ``"hold"``.
    - ``master_weights``: with a "-mixed" precision, hold the model in fp16/bf16 and let the
      optimizer step fp32 master copies (Apex's O2); checkpoints keep the fp32 values.
      ``"remainder"`` (with ``"bf16-mixed"``) keeps the same exact fp32 masters as the bf16 weights
      plus an int16 remainder each, 2 bytes per parameter less (see :mod:`amp_plugin.master_weights`).
      Default ``False``.
    - ``keep_fp32``: module classes whose weights stay fp32 when the model is cast; default: the
      normalization layers with master weights, nothing with "-true" precisions.
    - ``rounding``: how updates are written into "-true" weights: ``"nearest"`` (the optimizer's own
      arithmetic), ``"stochastic"`` (unbiased; small updates survive in expectation) or ``"kahan"``
      (a half-precision compensation buffer). Default ``"nearest"``.
    - ``rounding_seed``: seed of the stochastic rounding (the same on every rank). Default ``0``.
    - ``guard``: skip every optimizer step whose loss or gradients hold an inf/NaN, in every
      precision (parameters, master weights, rounding state and optimizer state stay as they were;
      the skip is counted and holds the scheduler). fp16 gets this from its loss scaler, the other
      precisions from a guard that scales nothing and costs one read-only pass over the gradients
      (none when a norm clip runs). ``False`` turns it off where no loss scaler runs (refused for
      fp16). Default ``True``.
    - ``fp8``: run the eligible ``nn.Linear`` layers' matmuls in fp8 through torchao (with
      ``"bf16-mixed"``): a recipe name (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``)
      or a :class:`~amp_plugin.fp8.Float8`. Default ``None`` (off).
    - ``fp32_grad_accumulation``: with half weights (master weights or "-true") and several
      backward passes per optimizer step, add the micro-batch gradients up in fp32 (4 bytes per
      trainable half parameter, held until the step) instead of in the half ``.grad``, whose
      every addition rounds to 8 (bf16) or 11 (fp16) significant bits; see
      :mod:`amp_plugin.grad_accumulation`. One device or DDP (which then averages the fp32 sums).
      Default ``True``.
    - ``spike_guard``: a :class:`~amp_plugin.spike.SpikeGuard` that also skips a step whose loss
      (or unscaled gradient norm) jumps far above its recent history (counted as a skip; the scale
      does not back off; kept in checkpoints). Default ``None`` (off).

    Example:
        >>> options: RunOptions = {"master_weights": True, "kernels": "torch"}
        >>> AMPRun("bf16-mixed", "cpu", **options).masters is None  # made when a model is converted
        True
        >>> sorted(RunOptions.__annotations__) == sorted(DEFAULTS)
        True
    """

    kernels: Backend
    fp32_modules: Sequence[type[nn.Module]]
    fp32_functions: Callable[..., Any] | Sequence[Callable[..., Any]]
    clip_fused: Literal["auto"] | bool
    lr_on_skip: Literal["hold", "advance"]
    master_weights: bool | Literal["remainder"]
    keep_fp32: Sequence[type[nn.Module]] | None
    rounding: Literal["nearest", "stochastic", "kahan"]
    rounding_seed: int
    guard: bool
    fp8: Recipe | Float8 | None
    fp32_grad_accumulation: bool
    spike_guard: SpikeGuard | None


DEFAULTS: dict[str, Any] = {
    "kernels": "auto",
    "fp32_modules": (),
    "fp32_functions": (),
    "clip_fused": "auto",
    "lr_on_skip": "hold",
    "master_weights": False,
    "keep_fp32": None,
    "rounding": "nearest",
    "rounding_seed": 0,
    "guard": True,
    "fp8": None,
    "fp32_grad_accumulation": True,
    "spike_guard": None,
}
"""Each keyword of :class:`RunOptions` and its default."""


def say_plainly(message: str, warn: bool) -> None:
    """The default ``say``: on rank zero, a ``UserWarning`` or an ``INFO`` log record (``amp_plugin``)."""
    if not is_rank_zero():
        return
    if warn:
        warnings.warn(message, stacklevel=3)
    else:
        logging.getLogger("amp_plugin").info(message)


class AMPRun:
    """The mixed precision of one training run, built once from the arguments every adapter takes.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"auto"``, ``"16-true"``, ``"bf16-true"`` or
            ``"32-true"`` (see :mod:`amp_plugin.precision`).
        device: the autocast device type; ``None`` leaves the precision unresolved until
            :meth:`resolve` (the Trainer's plugin resolves it at setup, from the model's device).
        scaler: the :class:`~amp_plugin.LossScaler` for fp16 (a ``torch.amp.GradScaler`` is
            converted with its settings and state); fp16 gets ``LossScaler()`` by default.
        call: how errors name the caller (``"AMPPrecision"``).
        say: how a message reaches the user on rank zero (an adapter passes its framework's).
        **options: the keywords of :class:`RunOptions`; an unknown one is refused with the closest
            known name.

    Example:
        >>> run = AMPRun("bf16-mixed", "cpu", master_weights=True)
        >>> run.precision, run.dtype, run.guard.get_scale(), run.scaler is None
        ('bf16-mixed', torch.bfloat16, 1.0, True)
        >>> AMPRun("16-mixed", "cpu", master_weight=True)
        Traceback (most recent call last):
        ...
        TypeError: AMPPrecision(master_weight=True) is not allowed... HINT: did you mean master_weights=...?
    """

    def __init__(
        self,
        precision: Precision = "auto",
        device: str | None = None,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        *,
        call: str = "AMPPrecision",
        say: Say = say_plainly,
        **options: Unpack[RunOptions],
    ) -> None:
        given = _checked_options(call, precision, scaler, dict(options))
        self.call, self.say = call, say
        self.requested: str = precision
        self.precision: str = precision  # "auto" until resolved
        self.kernels: Backend = given["kernels"]
        self.fp32_modules: tuple[type[nn.Module], ...] = given["fp32_modules"]
        self.fp32_functions: tuple[Callable[..., Any], ...] = given["fp32_functions"]
        self.clip_fused: Literal["auto"] | bool = given["clip_fused"]
        self.lr_on_skip: Literal["hold", "advance"] = given["lr_on_skip"]
        self.master_weights: bool | Literal["remainder"] = given["master_weights"]
        self.rounding: Literal["nearest", "stochastic", "kahan"] = given["rounding"]
        self.guard_on: bool = given["guard"]
        self.fp8: Float8 | None = given["fp8"]
        self.fp32_grad_accumulation: bool = given["fp32_grad_accumulation"]
        self.spike_guard: SpikeGuard | None = given["spike_guard"]
        self.fp8_report: Float8Report | None = None  # what convert() ran in fp8
        # Built once (it checks the functions and probes the autocast device types); entered per forward.
        self.fp32_mode = fp32_policy.Fp32Functions(self.fp32_functions) if self.fp32_functions else None
        # fp32_modules' hooks, per model (a GAN has two), until teardown; weak: a model is not kept alive.
        self._fp32_hooks: weakref.WeakKeyDictionary[nn.Module, fp32_policy.Fp32Modules] = (
            weakref.WeakKeyDictionary()
        )
        self.half: HalfWeights | None = (
            HalfWeights(self.master_weights, given["keep_fp32"], self.rounding, given["rounding_seed"])
            if self.master_weights or precision in ("16-true", "bf16-true")
            else None
        )
        self._scaler = (
            LossScaler.from_grad_scaler(scaler) if isinstance(scaler, torch.amp.GradScaler) else scaler
        )
        self.device: str | None = None
        self.dtype: torch.dtype | None = None
        self.driver: StepDriver | None = None  # built when the precision is resolved
        if device is not None:
            self.resolve(device)

    def __repr__(self) -> str:
        return f"AMPRun({self.requested!r}, device={self.device!r})"

    def __getstate__(self) -> dict[str, Any]:
        # A spawn (Fabric's "ddp_spawn") pickles the run into every process; weak references do not
        # pickle, so the hooked models go as strong ones (pickled alongside, shared, not copied twice).
        return {**self.__dict__, "_fp32_hooks": list(self._fp32_hooks.items())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _fp32_hooks=weakref.WeakKeyDictionary(state["_fp32_hooks"]))

    # -- the precision, resolved once --------------------------------------------------------------

    def resolve(self, device: object) -> tuple[str, torch.dtype]:
        """Resolve the precision on ``device``; build the scaler (fp16) or the guard and the step driver.

        Says (rank zero) what ``"auto"`` chose, and warns when a CPU without fp16/bf16
        instructions would emulate them. Resolving again (another device) keeps the scaler.
        """
        device_type = precisions.check_device(device, self.call)
        dtype = precisions.resolve_precision(self.requested, device_type, call=self.call)
        self.precision = self._said_precision(device_type, dtype)
        # A scaler comes only with fp16 (checked), which always resolves to fp16.
        if self._scaler is None and dtype == torch.float16:
            self._scaler = LossScaler(kernels=self.kernels)
        guard = guard_of(self._scaler, self.guard_on, self.kernels, self.spike_guard)
        if self.driver is None or self.driver.scaler is not guard:
            half = self.half
            self.driver = StepDriver(
                guard,
                None if half is None else half.before_step,
                self.kernels,
                None if half is None else half.grads_in_fp32,
            )
        self.device, self.dtype = device_type, dtype
        return device_type, dtype

    def _said_precision(self, device_type: str, dtype: torch.dtype) -> str:
        name = self.requested
        if name == "auto":
            name = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
            reason = precisions.auto_precision_reason(device_type)
            self.say(f"{self.call}('auto') chose {name}: {reason}", False)
        note = precisions.cpu_emulation_note(dtype) if device_type == "cpu" else None
        if note is not None and self.requested == "auto":  # a warning where "auto" chose it
            fix = "HINT: train in fp32 on this CPU (leave AMPPrecision out), or use a GPU or a CPU with AMX."
            # Two lines fit a terminal; said once per half type, whichever precision name asked for it.
            _say_once(self.say, f"{self.call}({name!r}): {note}.\n{fix}", True, key=f"{dtype} warning")
        elif note is not None:  # information where it was asked for by name
            faster = "as asked, it runs; fp32 (no AMPPrecision) would run faster here."
            message = f"{self.call}({name!r}): {note};\n{faster}"
            _say_once(self.say, message, False, key=f"{dtype} info")
        return name

    def settings(self, fallback_device: object) -> tuple[str, torch.dtype]:
        """The autocast device type and dtype; resolved on ``fallback_device`` if not yet."""
        if self.device is None or self.dtype is None:
            return self.resolve(fallback_device)
        return self.device, self.dtype

    def require_driver(self) -> StepDriver:
        """The step driver, resolving the precision on CUDA (where available) or the CPU if not yet."""
        if self.driver is None:
            self.resolve("cuda" if torch.cuda.is_available() else "cpu")
        assert self.driver is not None  # set by resolve
        return self.driver

    # -- the scaler and the guard ------------------------------------------------------------------

    @property
    def scaler(self) -> LossScaler | None:
        """The fp16 loss scaler (``None`` for the other precisions, and for ``"auto"`` until resolved)."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | torch.amp.GradScaler | None) -> None:
        new = assigned_scaler(self.call, self.precision, self.dtype, scaler)
        old, self._scaler = self._scaler, new
        if self.driver is not None and old is not None and self.driver.scaler is old:
            self.driver.scaler = new  # the steps read the driver's scaler
        if new is not None and self.spike_guard is not None:
            new.spike_guard = self.spike_guard

    @property
    def guard(self) -> LossScaler | None:
        """The :class:`~amp_plugin.LossScaler` checking every step: fp16's scaler, or a guard scaling nothing.

        ``None`` with ``guard=False``, or until the precision is resolved.
        """
        return None if self.driver is None else self.driver.scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped (``False`` before the first)."""
        return self.driver is not None and self.driver.last_step_skipped

    @property
    def weights(self) -> Literal["fp32", "master", "half"]:
        """What the optimizers step: fp32 weights, fp32 masters of half weights, or half weights ("-true").

        Example:
            >>> AMPRun("bf16-mixed", "cpu").weights, AMPRun("bf16-true", "cpu").weights
            ('fp32', 'half')
            >>> AMPRun("bf16-mixed", "cpu", master_weights="remainder").weights
            'master'
        """
        if self.half is None:
            return "fp32"
        return "master" if self.master_weights else "half"

    @property
    def masters(self) -> MasterWeights | None:
        """The fp32 master weights (``master_weights``, once the model is converted), else ``None``."""
        return self.half.masters if self.half is not None and self.master_weights else None

    # -- the model and the forward passes ----------------------------------------------------------

    def convert(self, module: nn.Module, device: object) -> Float8Report | None:
        """Cast ``module`` for master weights or a "-true" precision; convert its fp8 layers.

        ``device`` resolves the precision if it is not yet. Returns the fp8 report (``None``
        without fp8); a failed fp8 conversion leaves the model's layers as they were.
        """
        if self.half is not None:
            self.half.convert(module, self.settings(device)[1], self.fp32_modules)
        if self.fp8 is not None:
            self.fp8_report = fp8_layers.convert(module, self.fp8, self.fp32_modules)
        return self.fp8_report if self.fp8 is not None else None

    def attach(self, module: nn.Module | None, optimizers: Sequence[Optimizer]) -> None:
        """At fit start: check the model and ``optimizers`` against the run; hand them to the half weights.

        Refused (``ValueError``, nothing changed) is a set-up that would fail later (see
        :func:`~amp_plugin._fit_start.check_fit_start`); one that would mislead is said as a warning,
        as is LBFGS under the guard (it runs its closure itself, unchecked). ``module`` is the model the
        optimizers step (``None``: not known, nothing to check against). Resolves the precision on
        the module's device if it is not yet.

        Example:
            >>> run = AMPRun("16-mixed", "cpu")
            >>> model = nn.Linear(2, 1)
            >>> run.attach(model, [torch.optim.LBFGS(model.parameters())])
            Traceback (most recent call last):
            ...
            ValueError: AMPPrecision('16-mixed') cannot drive LBFGS: ... HINT: use precision='bf16-mixed' ...
        """
        if module is not None:
            device, dtype = self.settings(module_device(module))
            scaling = self._scaler is not None
            try:
                check_fit_start(module, optimizers, device, dtype, scaling, self.weights, self.say)
            except ValueError as refusal:
                if self.half is None or not self.half.converted(module):
                    raise
                cast = _CAST_BEFORE_REFUSAL.format(dtype=str(dtype).removeprefix("torch."))
                raise ValueError(f"{refusal} {cast}") from None
        if self.half is not None:
            self.half.attach(optimizers)
        elif self._scaler is None and self.guard_on and any(map(is_lbfgs, optimizers)):
            self.say(LBFGS_UNGUARDED, True)

    def force_fp32(self, module: nn.Module) -> None:
        """Run the ``fp32_modules`` classes inside ``module`` in fp32, autocast off (until teardown).

        Example:
            >>> run = AMPRun("bf16-mixed", "cpu", fp32_modules=[nn.Linear])
            >>> model = nn.Sequential(nn.Linear(2, 2))
            >>> run.force_fp32(model)
            >>> with run.autocast():
            ...     model(torch.ones(1, 2)).dtype
            torch.float32
        """
        if self.fp32_modules and module not in self._fp32_hooks:
            self._fp32_hooks[module] = fp32_policy.force_fp32(module, self.fp32_modules)

    def autocast(self) -> torch.autocast:
        """The autocast region of a forward pass (off under ``"32-true"``; the weight-cast cache off)."""
        device, dtype = self.device, self.dtype
        if device is None or dtype is None:
            device, dtype = self.resolve("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == torch.float32:
            return torch.autocast(device, enabled=False)
        # cache_enabled=False: a weight cast cached under no_grad would carry no autograd history
        # into a later forward with grad in the same autocast region.
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """Under "16-true"/"bf16-true", tensors made inside take the half dtype; else nothing changes."""
        dtype = true_dtype(self.requested)
        return nullcontext() if dtype is None else default_dtype(dtype)

    def forward_context(self) -> AbstractContextManager[Any]:
        """Autocast for a forward pass; with "-true" the half default dtype; inside, the fp32 functions.

        The ``torch.autocast`` itself where nothing else is entered.
        """
        autocast = self.autocast()
        half = true_dtype(self.requested)
        functions = self.fp32_mode if self.dtype != torch.float32 else None
        if half is None and functions is None:
            return autocast
        return _entered(autocast, default_dtype(half) if half is not None else None, functions)

    def metrics(self, grad_norm: float | None = None) -> dict[str, float]:
        """The ``amp/*`` values of the run so far (:func:`~amp_plugin._metrics.amp_metrics`), as floats.

        The skip rate is over every step of the run; ``grad_norm`` (``None``: not known) is the
        unscaled norm a clip returned (NaN on a step with a NaN gradient, and logged so). Reads the
        scale and the skip count from the device.

        Example:
            >>> AMPRun("16-mixed", "cpu").metrics(0.5)
            {'amp/scale': 65536.0, 'amp/skipped_steps': 0.0, 'amp/skip_rate': 0.0, 'amp/grad_norm': 0.5}
            >>> AMPRun("bf16-mixed", "cpu", guard=False).metrics()
            {}
        """
        guard, scaler = self.guard, self._scaler
        if guard is None:
            return {} if grad_norm is None else {"amp/grad_norm": grad_norm}
        skipped, total = guard.skipped_steps, guard.total_steps
        scale = math.nan if scaler is None else scaler.get_scale()
        return amp_metrics(scaler, scale, skipped, skipped / total if total else 0.0, grad_norm)

    # -- the run's state in a checkpoint -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (what a ``GradScaler`` saves, and ours) or the guard's, and the rounding's.

        A flat dict: the fp16 scaler's keys, or ``"guard"`` (the bf16/fp32 guard's skip counts);
        ``"rounding"`` (the stochastic rounding's generators) with a "-true" rounding. The fp32
        masters are not here: they are the model's own ``state_dict()``.

        Example:
            >>> AMPRun("16-mixed", "cpu").state_dict()["scale"]
            65536.0
            >>> AMPRun("bf16-mixed", "cpu").state_dict()["guard"]["skipped_steps"]
            0
        """
        return run_state(self._scaler, self.guard, self.half)

    def check_state_dict(self, state: dict[str, Any] | None, model_state: object = None) -> None:
        """Raise ``ValueError``/``TypeError`` if :meth:`load_state_dict` would refuse a part; change nothing.

        ``state`` as for :meth:`load_state_dict`; ``model_state``: the model's state dict beside it
        in a checkpoint, whose fp32 master entries must fit the master weights (``None``: unknown).
        """
        call = f"{self.call}.check_state_dict"
        load_run_state(state, self._scaler, self.guard, self.half, model_state, call, check_only=True)

    def load_state_dict(self, state: dict[str, Any] | None, model_state: object = None) -> None:
        """Load :meth:`state_dict`'s result, or a ``GradScaler``'s state; everything is checked first.

        Refused (``ValueError``/``TypeError``, nothing changed): a part that would not load
        (:meth:`check_state_dict`). ``None`` is a checkpoint without any: only ``model_state`` is
        checked. A state from another precision is said (``say``): a scale in a run without a
        scaler is ignored, and an fp16 run loading a state without one starts its scale afresh.
        """
        call = f"{self.call}.load_state_dict"
        note = load_run_state(state, self._scaler, self.guard, self.half, model_state, call)
        if note is not None:
            self.say(note, True)

    def teardown(self) -> None:
        """End of a fit: settle what waits for a next step (a held scheduler's check); unhook half weights
        and the ``fp32_modules`` hooks."""
        if self.driver is not None:
            self.driver.settle()
        if self.half is not None:
            self.half.detach()
        for hooks in self._fp32_hooks.values():
            hooks.remove()
        self._fp32_hooks.clear()


_CAST_BEFORE_REFUSAL = (
    "The model's weights were already cast to {dtype}: a fit (or fabric.setup) casts the model before "
    "its optimizers can be checked, and weights without an fp32 master keep only their {dtype} values. "
    "Rebuild the model, or load its fp32 weights, before trying again."
)


def run_state(
    scaler: LossScaler | None, guard: LossScaler | None, half: HalfWeights | None = None
) -> dict[str, Any]:
    """A run's state (:meth:`AMPRun.state_dict`): the loss ``scaler``'s keys, or ``"guard"`` (the state of
    a ``guard`` that is not the scaler), and ``"rounding"`` (the ``half`` weights' stochastic rounding).

    Example:
        >>> run_state(None, guard_of(None, True))["guard"]["total_steps"]
        0
    """
    state = {} if scaler is None else scaler.state_dict()
    if scaler is None and guard is not None:  # the guard's skip counts resume too
        state["guard"] = guard.state_dict()
    if half is not None and (rounding := half.rounding_state()) is not None:
        state["rounding"] = rounding
    return state


def load_run_state(
    state: dict[str, Any] | None,
    scaler: LossScaler | None,
    guard: LossScaler | None,
    half: HalfWeights | None = None,
    model_state: object = None,
    call: str = "load_state_dict",
    *,
    check_only: bool = False,
) -> str | None:
    """Check every part of ``state`` (:func:`run_state`'s, or a ``GradScaler``'s), then load it.

    Refused (``ValueError``/``TypeError``) before anything loads: a part that would not load, the
    masters in ``model_state`` that would not fit, a ``state`` that is not a dict (named as
    ``call``). ``None`` is a checkpoint without one: only ``model_state`` is checked.
    ``check_only`` stops after the checks. Returns the note to say where only one side has a
    loss-scaler state (:func:`load_scaler_state`).
    """
    scaler_state, guard_state, rounding = _state_parts(state, scaler, call)
    if scaler is not None and scaler_state:
        scaler.check_state_dict(scaler_state)
    if guard is not None and guard_state is not None:
        guard.check_state_dict(guard_state)
    if half is not None:
        half.check(rounding, model_state)
    if check_only or state is None:
        return None
    # The scaler or the guard first: each refuses a load in the middle of an iteration.
    note = load_scaler_state(scaler, scaler_state)
    if guard is not None and guard_state is not None:
        guard.load_state_dict(guard_state)
    if half is not None:
        half.load(rounding)
    return note


def _state_parts(
    state: dict[str, Any] | None, scaler: LossScaler | None, call: str
) -> tuple[dict[str, Any], dict[str, Any] | None, object]:
    """``state``'s scaler part, the guard's (where a guard checks, not a scaler), the rounding's.

    Raises ``TypeError`` for a ``state`` that is not a dict, ``ValueError`` for a ``"guard"`` that
    is not one.
    """
    if state is None:
        return {}, None, None
    if not isinstance(state, dict):
        fail(
            call,
            passed=f"state={type(state).__name__}",
            allowed="a dict: the state_dict() of AMPPrecision (Trainer or Fabric) or of a GradScaler",
            hint="pass what the plugin's state_dict() returned (or fabric.load's entry for it).",
            error=TypeError,
        )
    if "guard" in state and not isinstance(state["guard"], dict):
        guard = state["guard"]
        raise ValueError(
            f"The state has a 'guard' of {type(guard).__name__} {guard!r:.80}; expected the guard's "
            "state dict (LossScaler.state_dict()). HINT: the checkpoint is corrupt; resume without it "
            "or fix the entry."
        )
    scaler_state = {key: value for key, value in state.items() if key not in STATE_EXTRAS}
    # With a loss scaler, the scaler is the guard and its state the top level.
    guard_state = (state.get("guard") or None) if scaler is None else None
    return scaler_state, guard_state, state.get("rounding")


def guard_of(
    scaler: LossScaler | None, guard: bool, kernels: Backend = "auto", spike_guard: SpikeGuard | None = None
) -> LossScaler | None:
    """What checks a run's steps: its loss ``scaler``, else (``guard``) one that scales nothing; or ``None``.

    The guard is a :class:`~amp_plugin.LossScaler` with a static scale of 1: scaling by it changes
    nothing, and its unscale is a read-only check. ``spike_guard`` is handed to whichever checks.

    Example:
        >>> guard_of(None, True).get_scale(), guard_of(None, False)
        (1.0, None)
    """
    if scaler is None and guard:  # nothing to scale: a guard that only checks and skips
        scaler = LossScaler(init_scale=1.0, dynamic=False, kernels=kernels)
    if scaler is not None and spike_guard is not None:
        scaler.spike_guard = spike_guard
    return scaler


def load_scaler_state(scaler: LossScaler | None, state: dict[str, Any]) -> str | None:
    """Load a scaler ``state`` (a ``LossScaler``'s or a ``torch.amp.GradScaler``'s) into ``scaler``.

    Where only one side has a state (a bf16 run has no scaler, a bf16 checkpoint no scale), nothing
    loads and the note to warn with is returned; else ``None``.

    Example:
        >>> scaler = LossScaler("cpu")
        >>> load_scaler_state(scaler, LossScaler("cpu", init_scale=8.0).state_dict()), scaler.get_scale()
        (None, 8.0)
        >>> load_scaler_state(scaler, {})
        'The checkpoint holds no loss-scaler state (a bf16 run?); the scale starts afresh.'
    """
    if scaler is not None and state:
        scaler.load_state_dict(state)
    elif scaler is not None:
        return "The checkpoint holds no loss-scaler state (a bf16 run?); the scale starts afresh."
    elif state:
        return "The checkpoint holds a loss-scaler state, but this bf16 run has no scaler: ignored."
    return None


@contextmanager
def _entered(*contexts: AbstractContextManager[Any] | None) -> Any:
    with ExitStack() as stack:
        for context in contexts:
            if context is not None:
                stack.enter_context(context)
        yield


_SAID: set[str] = set()  # the keys _say_once said in this process, whichever adapter said them


def _say_once(say: Say, message: str, warn: bool, key: str) -> None:
    """Say ``message`` once per process for each ``key``, in the words of whoever asks first."""
    if key not in _SAID:
        _SAID.add(key)
        say(message, warn)


# -- the arguments, checked before anything is built -------------------------------------------------


def _checked_options(call: str, precision: object, scaler: object, options: dict[str, Any]) -> dict[str, Any]:
    """Every argument checked (``ValueError``/``TypeError``: what, allowed, ``HINT:``), with defaults."""
    for name in options:
        if name not in DEFAULTS:
            close = difflib.get_close_matches(name, list(DEFAULTS), n=1)
            fail(
                call,
                passed=f"{name}={options[name]!r:.40}",
                why=f"{call} takes no keyword {name!r}",
                allowed="precision, device, scaler and the keywords " + ", ".join(DEFAULTS),
                hint=f"did you mean {close[0]}=...?"
                if close
                else "see amp_plugin.RunOptions for each keyword.",
                error=TypeError,
            )
    given = {**DEFAULTS, **options}
    check_arguments(call, precision, scaler, given["clip_fused"], given["lr_on_skip"], given["guard"])
    given["spike_guard"] = check_spike_guard(call, given["spike_guard"], given["guard"])
    check_bool(call, "fp32_grad_accumulation", given["fp32_grad_accumulation"])
    given["fp8"] = check_fp8_request(call, given["fp8"], precision, given["master_weights"])
    given["keep_fp32"] = check_half_weights(
        call,
        str(precision),
        given["master_weights"],
        given["keep_fp32"],
        given["rounding"],
        given["rounding_seed"],
    )
    given["kernels"] = check_backend(given["kernels"], call, "kernels")
    given["fp32_modules"] = fp32_policy.check_module_classes(given["fp32_modules"], call, "fp32_modules")
    given["fp32_functions"] = fp32_policy.check_functions(given["fp32_functions"], call, "fp32_functions")
    return given


def check_arguments(
    call: str, precision: object, scaler: object, clip_fused: object, lr_on_skip: object, guard: object = True
) -> None:
    """Raise ``ValueError``/``TypeError`` (what, allowed, ``HINT:``) for precision, scaler, step arguments.

    Example:
        >>> check_arguments("AMPPrecision", "16-mixed", LossScaler("cpu"), "auto", "hold")
        >>> check_arguments("AMPPrecision", "bf16-mixed", LossScaler("cpu"), "auto", "hold")
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='bf16-mixed', scaler=LossScaler) is not allowed here: ... HINT: ...
    """
    check_precision(precision, call)
    if scaler is not None and not isinstance(scaler, (LossScaler, torch.amp.GradScaler)):
        fail(
            call,
            passed=f"scaler={scaler!r:.60}",
            allowed="an amp_plugin.LossScaler or a torch.amp.GradScaler",
            hint="pass LossScaler(...) (it takes GradScaler's arguments), or leave scaler=None.",
            error=TypeError,
        )
    if scaler is not None and precision in ("bf16-mixed", "bf16-true", "32-true"):
        fail(
            call,
            passed=f"precision={precision!r}, scaler={type(scaler).__name__}",
            why=f"precision={precision!r} does not use a loss scaler",
            allowed="scaler= with '16-mixed' or '16-true' only",
            hint="drop scaler=, or use precision='16-mixed'.",
        )
    if scaler is not None and not scaler.is_enabled():
        fail(
            call,
            passed=f"scaler={type(scaler).__name__} (disabled)",
            why="a disabled scaler would train fp16 with neither loss scaling nor an inf check",
            allowed="an enabled scaler, or scaler=None",
            hint=(
                "leave scaler=None (the plugin makes a LossScaler for the device it trains on), or pass one "
                "for that device, e.g. LossScaler('cpu'); a scaler for 'cuda' is disabled where CUDA is not "
                "available. fp16 without scaling, still guarded: LossScaler(init_scale=1.0, dynamic=False)."
            ),
        )
    check_bool(call, "guard", guard)
    if guard is False and precision in ("16-mixed", "16-true"):
        fail(
            call,
            passed=f"precision={precision!r}, guard=False",
            why="fp16's loss scaler always checks and skips",
            allowed="guard=False with bf16 or fp32 only, where no loss scaler runs",
            hint="drop guard=False.",
        )
    if scaler is not None and precision == "auto":
        fail(
            call,
            passed=f"precision='auto', scaler={type(scaler).__name__}",
            why="'auto' with a scaler is ambiguous: it picks bf16, which uses no scaler, where it can",
            allowed="scaler= with an explicit fp16 precision ('16-mixed' or '16-true')",
            hint="pass precision='16-mixed' together with the scaler.",
        )
    check_choice(call, "clip_fused", clip_fused, ("auto", True, False), "use 'auto' (or a real bool).")
    check_choice(call, "lr_on_skip", lr_on_skip, ("hold", "advance"), "use 'hold'.")


def check_half_weights(
    call: str,
    precision: str,
    master_weights: object,
    keep_fp32: object,
    rounding: object,
    rounding_seed: object,
) -> tuple[type[nn.Module], ...] | None:
    """Check the half-precision-weight arguments; return ``keep_fp32`` as a tuple.

    Master weights go with the "-mixed" precisions (and "auto"), a rounding other than
    "nearest" with the "-true" ones, where the weights have no fp32 copy.

    Example:
        >>> check_half_weights("AMPPrecision", "16-mixed", True, None, "nearest", 0)
        >>> check_half_weights("AMPPrecision", "bf16-true", True, None, "nearest", 0)
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='bf16-true', master_weights=True) is not allowed here: ...
    """
    check_master_weights(call, master_weights)
    if master_weights == "remainder" and precision != "bf16-mixed":
        fail(
            call,
            passed=f"precision={precision!r}, master_weights='remainder'",
            why="an fp32 master is exactly a bf16 value plus 16 more bits, and no other precision's value",
            allowed="master_weights='remainder' with precision='bf16-mixed' only",
            hint="use precision='bf16-mixed', or master_weights=True (fp32 masters) for fp16.",
        )
    check_choice(call, "rounding", rounding, ROUNDINGS, "use 'stochastic' (or 'nearest').")
    check_int(call, "rounding_seed", rounding_seed, low=0)
    keep = None
    if keep_fp32 is not None:
        keep = fp32_policy.check_module_classes(keep_fp32, call, "keep_fp32")
    true = precision.endswith("-true")
    if master_weights and precision == "32-true":
        fail(
            call,
            passed=f"precision={precision!r}, master_weights={master_weights!r}",
            why="the weights are fp32 already: there is no half copy for fp32 masters to stand behind",
            allowed="master weights with '16-mixed', 'bf16-mixed' or 'auto'",
            hint="drop master_weights for fp32 training, or use precision='16-mixed' with master_weights.",
        )
    if master_weights and true:
        fail(
            call,
            passed=f"precision={precision!r}, master_weights=True",
            why=f"precision={precision!r} keeps the weights in half, with no fp32 copy to master",
            allowed="master weights with '16-mixed', 'bf16-mixed' or 'auto'",
            hint=(
                f"use precision={precision.replace('-true', '-mixed')!r} with master_weights=True (fp32 "
                "masters), or drop master_weights for weights held in half only."
            ),
        )
    if rounding != "nearest" and (not true or precision == "32-true"):
        fail(
            call,
            passed=f"precision={precision!r}, rounding={rounding!r}",
            why="weights held in fp32 lose nothing to rounding",
            allowed="a rounding other than 'nearest' with '16-true' or 'bf16-true' only",
            hint=(
                "use precision='bf16-true' with rounding=..., or drop rounding (fp32 weights and masters "
                "round nothing away)."
            ),
        )
    if keep is not None and not (master_weights or precision in ("16-true", "bf16-true")):
        fail(
            call,
            passed=f"keep_fp32={keep_fp32!r}",
            why="only a cast model has weights to keep in fp32",
            allowed="keep_fp32 with master_weights=True or a '16-true'/'bf16-true' precision",
            hint="drop keep_fp32; under autocast every weight stays fp32 anyway.",
        )
    return keep


def assigned_scaler(
    call: str, precision: str, dtype: torch.dtype | None, scaler: object, grad_scaler: bool = True
) -> LossScaler | None:
    """The scaler ``plugin.scaler = scaler`` installs (a ``GradScaler`` converted); raise if it cannot work.

    ``precision`` is the run's, ``dtype`` its resolved one (``None`` while ``"auto"`` is not
    resolved). Refused: anything but a ``LossScaler`` (or, with ``grad_scaler``, a
    ``torch.amp.GradScaler``), a scaler for a precision without loss scaling, ``None`` for fp16
    (it would train without scaling), a disabled scaler.

    Example:
        >>> scaler = LossScaler("cpu", init_scale=4.0)
        >>> assigned_scaler("AMPPrecision", "16-mixed", torch.float16, scaler) is scaler
        True
        >>> assigned_scaler("AMPPrecision", "bf16-mixed", torch.bfloat16, LossScaler("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision.scaler(LossScaler) is not allowed here: ...
    """
    types = (LossScaler, torch.amp.GradScaler) if grad_scaler else (LossScaler,)
    what, prop = f"{type(scaler).__name__}", f"{call}.scaler"
    if scaler is not None and not isinstance(scaler, types):
        fail(
            prop,
            passed=f"{what} {scaler!r:.60}",
            allowed="an amp_plugin.LossScaler" + " or a torch.amp.GradScaler" * grad_scaler,
            hint="assign LossScaler(...) (it takes GradScaler's arguments).",
            error=TypeError,
        )
    fp16 = dtype == torch.float16 if dtype is not None else precision in ("16-mixed", "16-true")
    if scaler is not None and not fp16:
        why = (
            "'auto' is not resolved yet, and it picks bf16, which uses no scaler, where it can"
            if dtype is None and precision == "auto"
            else f"`precision={precision!r}` does not use a scaler; only fp16 ('16-mixed', '16-true') does"
        )
        fail(
            prop,
            passed=what,
            why=why,
            allowed="a scaler with fp16 ('16-mixed', '16-true') only",
            hint=f"leave {call}.scaler as None, or build the plugin with precision='16-mixed'.",
        )
    if scaler is None and fp16:
        fail(
            prop,
            passed="None",
            why=f"fp16 (precision={precision!r}) needs a loss scaler: without one it trains unscaled",
            allowed="a LossScaler",
            hint="assign a LossScaler, e.g. LossScaler('cpu') or LossScaler('cuda').",
        )
    new = LossScaler.from_grad_scaler(scaler) if isinstance(scaler, torch.amp.GradScaler) else scaler
    if new is not None and not new.is_enabled():
        fail(
            prop,
            passed=f"{what} (disabled)",
            why="a disabled scaler would train fp16 without loss scaling or an inf check",
            allowed="an enabled scaler",
            hint="assign one for the device you train on, e.g. LossScaler('cpu').",
        )
    return new
