"""``AMPPrecision``: Lightning's precision hooks, delegated to amp_plugin's plain-torch pieces.

A thin adapter: autocast comes from :mod:`amp_plugin.autocast`, fp32 modules and functions from
:mod:`amp_plugin.fp32_policy`, scaling and skipping from :class:`~amp_plugin.LossScaler`, clipping
from :mod:`amp_plugin.clipping`. Its neighbours in :mod:`amp_plugin.lightning` hold the rest:
argument and fit-start checks (``checks``), the checkpoint entry (``checkpoint``), the clipping
hooks' checks, the skip-aware LR scheduler (``schedulers``), and every read of a
Lightning internal (``_compat``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin import fp8 as fp8_layers
from amp_plugin import fp32_policy
from amp_plugin._validation import fail
from amp_plugin.fp8 import Float8, Float8Report, Recipe, check_fp8_request
from amp_plugin.half_weights import HalfWeights
from amp_plugin.kernels import Backend, check_backend
from amp_plugin.lightning import _compat, checks
from amp_plugin.lightning import checkpoint as checkpoints
from amp_plugin.lightning.opt_levels import opt_level_arguments
from amp_plugin.master_weights import MasterWeights
from amp_plugin.precision import Precision as PrecisionName
from amp_plugin.precision import default_dtype, true_dtype
from amp_plugin.scaler import LossScaler
from amp_plugin.schedulers import SkipAwareScheduler
from amp_plugin.spike import SpikeGuard, check_spike_guard
from amp_plugin.step import StepDriver

__all__ = ["AMPPrecision"]


class AMPPrecision(MixedPrecision):
    """Mixed precision for ``Trainer(plugins=[AMPPrecision(...)])``.

    A :class:`~lightning.pytorch.plugins.precision.MixedPrecision` to Lightning (its
    ThroughputMonitor and checkpoint code treat it as one), driving a :class:`LossScaler`.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling, honoured on CPU too),
            ``"bf16-mixed"``, ``"auto"`` (bf16 where the device supports it, else fp16),
            ``"16-true"`` / ``"bf16-true"`` (the weights themselves in fp16/bf16, no fp32 copy;
            fp16 keeps loss scaling; forward passes still run under autocast), or ``"32-true"``
            (fp32, autocast off: Apex's O0). See :meth:`from_opt_level` for Apex's ladder.
        device: the autocast device type; ``None`` takes it from the model's device at setup.
        scaler: the :class:`LossScaler` for fp16 (a ``torch.amp.GradScaler`` is converted with its
            settings and state); fp16 gets ``LossScaler()`` by default.
        kernels: kernel backend for the default scaler and for clipping.
        fp32_modules: module classes whose forward runs in fp32 with autocast off.
        fp32_functions: torch functions (``torch.sigmoid``, ``torch.Tensor.softmax``, ``F.gelu``)
            whose calls in forward passes run in fp32 with autocast off, through
            :class:`~amp_plugin.fp32_policy.Fp32Functions` (Apex's ``register_float_function``).
        clip_fused: ``"auto"`` takes the fast clipping path (norm and inf check on the
            still-scaled gradients, one combined multiply or a fold into a fused optimizer)
            unless the LightningModule or a callback overrides ``on_before_optimizer_step``
            or ``configure_gradient_clipping``; ``True`` always takes it (those hooks then see
            scaled gradients); ``False`` unscales before the hooks, as Lightning does.
        master_weights: with a "-mixed" precision, hold the model in fp16/bf16 and let the
            optimizer step fp32 master copies (Apex's O2); checkpoints keep the fp32 values.
            ``"remainder"`` (with ``"bf16-mixed"``) keeps the same exact fp32 masters as the bf16
            weights plus an int16 remainder each: 2 bytes per parameter less (see
            :mod:`amp_plugin.master_weights`).
        keep_fp32: module classes whose weights stay fp32 when the model is cast; default: the
            normalization layers with master weights, nothing with "-true" precisions.
        rounding: how updates are written into "-true" weights: ``"nearest"`` (the optimizer's
            own arithmetic, as Lightning's "bf16-true"), ``"stochastic"`` (unbiased; small updates
            survive in expectation) or ``"kahan"`` (a half-precision compensation buffer).
        rounding_seed: seed of the stochastic rounding (the same on every rank).
        guard: skip every optimizer step whose loss or gradients hold an inf/NaN, in every
            precision (parameters, master weights, rounding state and optimizer state stay as
            they were; the skip is counted and holds the scheduler). fp16 gets this from its
            loss scaler; the other precisions from :attr:`guard`, which scales nothing and costs
            one read-only pass over the gradients (none when a norm clip runs). ``False`` turns
            it off where no loss scaler runs (refused for fp16, whose scaler always checks).
        lr_on_skip: ``"hold"`` keeps a step-interval LR scheduler still when its optimizer's
            step was skipped (or not taken: ``training_step`` returned ``None``); ``"advance"``
            steps it anyway, without PyTorch's misleading order warning. In manual optimization
            declare the scheduler with ``"interval": "step"`` to have it held.
        fp8: run the eligible ``nn.Linear`` layers' matmuls in fp8 through torchao (with
            ``"bf16-mixed"``): a recipe name (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``) or a :class:`~amp_plugin.fp8.Float8` (recipe, layer filter);
            the choice is reported at fit start and kept in :attr:`fp8_report`.
        fp32_grad_accumulation: with half weights (master weights or "-true") and
            ``Trainer(accumulate_grad_batches > 1)``, add the micro-batch gradients up in fp32
            (4 bytes per trainable half parameter, held from the first micro-batch to the step)
            instead of in the half ``.grad``, whose every addition rounds to 8 (bf16) or 11 (fp16)
            significant bits; see :mod:`amp_plugin.grad_accumulation`. Single-device strategies
            only: under DDP and the other strategies it is off, with a warning.
        spike_guard: a :class:`~amp_plugin.spike.SpikeGuard` that also skips a step whose loss
            (or, with ``on=("loss", "grad_norm")``, unscaled gradient norm) jumps far above its
            recent history (counted as a skip; the scale does not back off; kept in checkpoints).
            It is handed to the :attr:`guard`.

    Example:
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> plugin.precision, plugin.dtype, type(plugin.scaler).__name__
        ('16-mixed', torch.float16, 'LossScaler')
    """

    precision: PrecisionName | str  # type: ignore[assignment]  # "auto" until resolved; Lightning's Literal lacks it
    device: str | None  # type: ignore[assignment]  # None until resolved at setup

    def __init__(  # MixedPrecision.__init__ is not called: it would build a torch GradScaler
        self,
        precision: PrecisionName = "auto",
        device: str | None = None,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        kernels: Backend = "auto",
        fp32_modules: Sequence[type[nn.Module]] = (),
        clip_fused: Literal["auto"] | bool = "auto",
        lr_on_skip: Literal["hold", "advance"] = "hold",
        master_weights: bool | Literal["remainder"] = False,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        rounding: Literal["nearest", "stochastic", "kahan"] = "nearest",
        rounding_seed: int = 0,
        fp32_functions: Callable[..., Any] | Sequence[Callable[..., Any]] = (),
        guard: bool = True,
        fp8: Recipe | Float8 | None = None,
        fp32_grad_accumulation: bool = True,
        spike_guard: SpikeGuard | None = None,
    ) -> None:
        checks.check_arguments(precision, scaler, clip_fused, lr_on_skip, guard)
        self.spike_guard = check_spike_guard("AMPPrecision", spike_guard, guard)
        if not isinstance(fp32_grad_accumulation, bool):
            fail(
                "AMPPrecision",
                passed=f"fp32_grad_accumulation={fp32_grad_accumulation!r:.60}",
                allowed="True or False",
                hint="pass False to add micro-batch gradients up in the half .grad (2 bytes per parameter).",
                error=TypeError,
            )
        self.fp32_grad_accumulation = fp32_grad_accumulation
        self.fp8 = check_fp8_request("AMPPrecision", fp8, precision, master_weights)
        self.fp8_report: Float8Report | None = None  # what convert_module ran in fp8
        keep = checks.check_half_weights(precision, master_weights, keep_fp32, rounding, rounding_seed)
        self.kernels = check_backend(kernels, "AMPPrecision", "kernels")
        self.fp32_modules = fp32_policy.check_module_classes(fp32_modules, "AMPPrecision", "fp32_modules")
        self.fp32_functions = fp32_policy.check_functions(fp32_functions, "AMPPrecision", "fp32_functions")
        # Built once (it checks the functions and probes the autocast device types); entered per forward.
        self._fp32_mode = fp32_policy.Fp32Functions(self.fp32_functions) if self.fp32_functions else None
        self.clip_fused = clip_fused
        self.lr_on_skip = lr_on_skip
        self.master_weights = master_weights
        self.rounding = rounding
        self.requested = precision
        self._half: HalfWeights | None = (
            HalfWeights(master_weights, keep, rounding, rounding_seed)
            if master_weights or precision in ("16-true", "bf16-true")
            else None
        )
        self._scaler = (
            LossScaler.from_grad_scaler(scaler) if isinstance(scaler, torch.amp.GradScaler) else scaler
        )
        self.device = None
        self.dtype: torch.dtype | None = None
        self.precision = precision  # "auto" until resolved at setup
        self.last_grad_norm: Tensor | None = None  # unscaled, before clipping, when a clip computed it
        self._fp32_hooks: fp32_policy.Fp32Modules | None = None
        self._fast_clip = clip_fused is True
        self._want_grad_norm = self._norm_clipped = self._no_clip = False
        self._guard = guard
        self._driver: StepDriver | None = None  # built when the precision is resolved
        if device is not None:
            self._resolve(device)

    def __repr__(self) -> str:
        # Lightning names a plugin it refuses ("Received both `precision=...` and `plugins=...`") by str().
        return f"amp_plugin.AMPPrecision({self.requested!r})"

    @classmethod
    def from_opt_level(cls, level: Literal["O0", "O1", "O2", "O3"], **overrides: Any) -> AMPPrecision:
        """The plugin for Apex opt level ``level``; ``overrides`` take Apex's or this class's keywords.

        O0 is fp32, O1 autocast with dynamic loss scaling, O2 an fp16 model with fp32 norms and
        master weights, O3 pure fp16 (static loss scale 1.0, as in Apex). See
        :mod:`amp_plugin.lightning.opt_levels` for the table and the keywords.

        Example:
            >>> plugin = AMPPrecision.from_opt_level("O2", device="cpu")
            >>> plugin.precision, plugin.master_weights
            ('16-mixed', True)
            >>> AMPPrecision.from_opt_level("O2", cast_model_type=torch.bfloat16).requested
            'bf16-mixed'
        """
        return cls(**opt_level_arguments(level, **overrides))

    # -- set-up ---------------------------------------------------------------------------------

    def _resolve(self, device: object) -> tuple[str, torch.dtype]:
        device_type, dtype, self.precision = checks.resolve_settings(self.requested, device)
        # A scaler comes only with "16-mixed" (check_arguments), which always resolves to fp16.
        if self._scaler is None and dtype == torch.float16:
            self._scaler = LossScaler(kernels=self.kernels)
        guard = self.scaler
        if guard is None and self._guard:  # nothing to scale: a guard that only checks and skips
            guard = LossScaler(init_scale=1.0, dynamic=False, kernels=self.kernels)
        if guard is not None and self.spike_guard is not None:
            guard.spike_guard = self.spike_guard
        if self._driver is None or self._driver.scaler is not guard:
            self._driver = StepDriver(
                guard, None if self._half is None else self._half.before_step, self.kernels
            )
        self.device, self.dtype = device_type, dtype
        return device_type, dtype

    def _settings(self, fallback_device: object) -> tuple[str, torch.dtype]:
        """The autocast device type and dtype; resolved from ``fallback_device`` if not yet."""
        if self.device is None or self.dtype is None:
            return self._resolve(fallback_device)
        return self.device, self.dtype

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the model's weights to fp16/bf16 for master weights or a "-true" precision.

        Strategies call this before moving the model, wrapping it (DDP) and building its
        optimizers; so the masters are made from the original fp32 values.
        """
        if _compat.called_by_fabric():  # Fabric's setup: the wrong one of the two AMPPrecision classes
            raise TypeError(_IN_FABRIC.format(self=self))
        if self._half is not None:
            trainer = _compat.attached_trainer(module) if isinstance(module, LightningModule) else None
            device = trainer.strategy.root_device if trainer is not None else checks.module_device(module)
            self._half.convert(module, self._settings(device)[1], self.fp32_modules)
        if self.fp8 is not None:
            self.fp8_report = fp8_layers.convert(module, self.fp8, self.fp32_modules)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """With half weights, floating-point inputs take the weights' dtype (as in Lightning's "-true")."""
        if self._half is None or self.dtype is None:
            return data
        return apply_to_collection(data, Tensor, _to_dtype, self.dtype)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        device, dtype = self._settings(checks.module_device(model))
        module = checks.lightning_module(model)  # strategies hand over their wrapper (DDP, ...)
        checks.check_fit_start(
            module,
            optimizers,
            device,
            dtype,
            grad_scaling=self.scaler is not None,
            weights="fp32" if self._half is None else "master" if self.master_weights else "half",
        )
        if self._half is not None:
            self._half.attach(optimizers)
            self._half.accumulate_in_fp32(self._accumulates_in_fp32(model, module))
        lbfgs = any(map(checks.is_lbfgs, optimizers))
        if lbfgs and self.scaler is None and self._half is None and self._guard:
            rank_zero_warn(checks.LBFGS_UNGUARDED)
        if self.fp8_report is not None:
            rank_zero_info(f"AMPPrecision: {self.fp8_report}")
        if self._fp32_hooks is None and self.fp32_modules:
            self._fp32_hooks = fp32_policy.force_fp32(module, self.fp32_modules)
        if isinstance(module, LightningModule) and (trainer := _compat.attached_trainer(module)) is not None:
            self._fast_clip = self.clip_fused is True or (
                self.clip_fused == "auto" and not checks.hooks_observe_gradients(module, trainer)
            )
        for config in lr_schedulers:  # automatic and manual optimization alike
            if getattr(config, "interval", "step") == "step" and not isinstance(
                config.scheduler, SkipAwareScheduler
            ):
                config.scheduler = SkipAwareScheduler(
                    config.scheduler, self._require_driver(), self.lr_on_skip
                )
        return model, optimizers, lr_schedulers

    def _accumulates_in_fp32(self, model: nn.Module, module: nn.Module) -> bool:
        """Whether this fit adds micro-batches up in fp32: asked for, accumulating, one device."""
        trainer = _compat.attached_trainer(module) if isinstance(module, LightningModule) else None
        if not self.fp32_grad_accumulation or trainer is None or trainer.accumulate_grad_batches <= 1:
            return False
        if isinstance(trainer.strategy, SingleDeviceStrategy):
            return True
        # DDP all-reduces the .grad it finds at the last micro-batch; a hook that empties .grad after
        # every backward would hand it only that micro-batch, so the fp32 path stays single-device.
        rank_zero_warn(_NO_FP32_ACCUMULATION.format(strategy=type(trainer.strategy).__name__))
        return False

    @override
    def teardown(self) -> None:
        if self._half is not None:
            self._half.detach()
        if self._fp32_hooks is not None:
            self._fp32_hooks.remove()
            self._fp32_hooks = None

    # -- autocast -------------------------------------------------------------------------------

    @override
    def autocast_context_manager(self) -> torch.autocast:
        """The autocast context for forward passes (the weight-cast cache off, as in Lightning)."""
        device, dtype = self._settings("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == torch.float32:  # "32-true"
            return torch.autocast(device, enabled=False)
        # cache_enabled=False: a weight cast cached under no_grad would carry no autograd history
        # into a later forward with grad in the same autocast region.
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """With "-true", tensors and layers are created in the half dtype (Lightning's ``HalfPrecision``)."""
        dtype = true_dtype(self.requested)
        return nullcontext() if dtype is None else default_dtype(dtype)

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast for every step (training, validation, test, predict); inside it, the fp32 functions.

        With "-true", tensors created in the step take the half dtype too.
        """
        with ExitStack() as stack:
            stack.enter_context(self.autocast_context_manager())
            stack.enter_context(self.tensor_init_context())
            if self._fp32_mode is not None and self.dtype != torch.float32:
                stack.enter_context(self._fp32_mode)
            yield

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # Once per batch, before any clip: a manual clip_gradients() records the norm that
        # optimizer_step must not forget.
        self.last_grad_norm = None
        with self.forward_context():
            yield
        # Manual optimization: one update per training batch, after every optimizer's step.
        if self._driver is not None:
            self._driver.end_batch()

    # -- backward and step ----------------------------------------------------------------------

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # The hooks get the loss as the user computed it; only backward sees the scaled one.
        _compat.before_backward_hooks(self, tensor, module)
        guard = self._require_driver().scaler
        return tensor if guard is None else guard.scale(tensor)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        self._require_driver().backward_done()
        # torch runs backward best with autocast off; manual_backward sits inside training_step's region
        # (automatic optimization calls backward outside it, where there is nothing to turn off).
        device = self.device or "cpu"
        if not torch.is_autocast_enabled(device):
            model.backward(tensor, *args, **kwargs)  # what Precision.backward does
            return
        with torch.autocast(device, enabled=False):
            model.backward(tensor, *args, **kwargs)  # what Precision.backward does

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        driver = self._require_driver()
        if self.scaler is None and self._half is None and checks.is_lbfgs(optimizer):
            # LBFGS runs its closure itself, several times per step (Lightning's Precision path).
            return super(MixedPrecision, self).optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # the half gradients must exist before the masters take them
        if closure_result is None and model.automatic_optimization:
            if self._half is not None:  # the hooks and the next zero_grad see the sums, as without it
                self._half.flush_gradients(optimizer)
            self._no_clip = True
            try:
                driver.not_stepped(optimizer, lambda: self._observe_gradients(model, optimizer))
            finally:
                self._no_clip = False
            self.last_grad_norm = None
            return closure_result
        return driver.step(
            optimizer,
            lambda: self._run_hooks(model, optimizer),
            observe_unscaled=not self._fast_clip,
            update=model.automatic_optimization,
            **kwargs,
        )

    def _run_hooks(self, model: LightningModule, optimizer: Any) -> bool:
        """``on_before_optimizer_step`` and clipping; whether a norm clip ran (it checked the gradients)."""
        self._norm_clipped = False
        self._observe_gradients(model, optimizer)
        return self._norm_clipped

    def _require_driver(self) -> StepDriver:
        if self._driver is None:
            self._resolve("cuda" if torch.cuda.is_available() else "cpu")
        assert self._driver is not None  # set by _resolve
        return self._driver

    def _observe_gradients(self, model: LightningModule, optimizer: Any) -> None:
        """Between backward and step: the ``on_before_optimizer_step`` hooks, then clipping, then the norm."""
        _compat.after_closure(self, model, optimizer)  # Lightning's own order of the two
        if self._want_grad_norm and self.last_grad_norm is None:
            self.last_grad_norm = self._require_driver().grad_norm(optimizer)
        self._want_grad_norm = False

    @property
    def masters(self) -> MasterWeights | None:
        """The fp32 master weights (``master_weights=True``, after the model was converted), else ``None``."""
        return self._half.masters if self._half is not None and self.master_weights else None

    # -- checkpoints ----------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        # Lightning files a non-empty state_dict under this class's __qualname__, which a rename
        # or subclass would orphan; the state goes under CHECKPOINT_KEY in on_save_checkpoint.
        return {}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.save_entry(checkpoint, str(self.precision), self.scaler, self.guard, self._half)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.load_entry(checkpoint, self.scaler, self.guard, self._half)

    def check_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Raise ``ValueError`` if the checkpoint's plugin state would not load; change nothing.

        Checked: the loss-scaler (or guard) state, and with half-precision weights the fp32 master
        values (shapes) and the rounding state. Lightning restores the precision plugin only after
        it has replaced the model's weights. To refuse a corrupt checkpoint before that, call this
        from the LightningModule's ``on_load_checkpoint``, the one hook Lightning runs earlier::

            def on_load_checkpoint(self, checkpoint):
                self.trainer.precision_plugin.check_checkpoint(checkpoint)

        Example:
            >>> AMPPrecision("16-mixed", device="cpu").check_checkpoint({"amp_plugin": "garbage"})
            Traceback (most recent call last):
            ...
            ValueError: The checkpoint's 'amp_plugin' entry is str 'garbage'; ... HINT: ...
        """
        checkpoints.check_entry(checkpoint, self.scaler, self.guard, self._half)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state (from this plugin, ``LossScaler``, or ``torch.amp.GradScaler``)."""
        checkpoints.load_scaler_state(self.scaler, state_dict)

    # -- clipping and the gradient norm ----------------------------------------------------------

    def request_grad_norm(self) -> None:
        """Have the next optimizer step record ``last_grad_norm`` even without clipping.

        With clipping on, the norm comes free with the clip; otherwise it costs one read of the
        gradients, which is why it is asked for per step (e.g. on logging steps only).
        """
        self._want_grad_norm = True

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0 or self._no_clip:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._norm_clipped = True
        self.last_grad_norm = self._require_driver().clip_grad_norm_(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._want_grad_norm and self.last_grad_norm is None:  # the norm before clipping
            self.last_grad_norm = self._require_driver().grad_norm(optimizer)
        self._require_driver().clip_grad_value_(optimizer, float(clip_val))

    scaler = checks.scaler_property(  # MixedPrecision has a GradScaler attribute here
        "AMPPrecision",
        """The fp16 loss scaler (``None`` for the other precisions, and for ``"auto"`` until resolved).

        Assigning one between steps (``precision.scaler = LossScaler(...)``) makes the steps use it:
        it is also the :attr:`guard`. A ``torch.amp.GradScaler`` is converted, as in the constructor.
        Refused (``TypeError``/``ValueError``, nothing changed): anything else, a scaler for a
        precision without loss scaling, ``None`` for fp16.

        Example:
            >>> plugin = AMPPrecision("16-mixed", device="cpu")
            >>> plugin.scaler = LossScaler("cpu", init_scale=8.0)
            >>> plugin.guard is plugin.scaler, plugin.scaler.get_scale()
            (True, 8.0)
        """,
    )

    @property
    def guard(self) -> LossScaler | None:
        """The :class:`LossScaler` that checks every step and skips non-finite ones.

        The fp16 loss scaler itself (``scaler``), or for bf16, fp32 and the "-true" precisions
        a guard that scales nothing (a static scale of 1) and checks the gradients read-only.
        ``None`` with ``guard=False``, or until the precision is resolved at setup.
        """
        return None if self._driver is None else self._driver.scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped (``False`` before the first).

        Right after ``opt.step()`` in manual optimization it describes that step; after the
        batch's scale update, whether any step of the batch was skipped.
        """
        return self._driver is not None and self._driver.last_step_skipped

    @property
    def driver(self) -> StepDriver | None:
        """The :class:`~amp_plugin.step.StepDriver` of this plugin's steps (which were skipped, per
        optimizer and per batch); ``None`` until the precision is resolved at setup."""
        return self._driver


_NO_FP32_ACCUMULATION = (
    "AMPPrecision: fp32 gradient accumulation is off under {strategy} (it runs with single-device "
    "strategies only); micro-batch gradients add up in the half-precision .grad, rounding each sum. "
    "HINT: pass AMPPrecision(fp32_grad_accumulation=False) to silence this, or use fewer, larger "
    "micro-batches."
)

_IN_FABRIC = (
    "Fabric(plugins=[amp_plugin.AMPPrecision({self.requested!r})]) is not allowed here: that is the "
    "Trainer's plugin. Allowed: amp_plugin.fabric.AMPPrecision (the same arguments). "
    "HINT: from amp_plugin.fabric import AMPPrecision"
)


def _to_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
