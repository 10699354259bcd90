"""``AMPPrecision``: Lightning's precision hooks, delegated to amp_plugin's plain-torch pieces.

A thin adapter: autocast comes from :mod:`amp_plugin.autocast`, scaling and skipping from
:class:`~amp_plugin.LossScaler`, clipping from :mod:`amp_plugin.clipping`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from amp_plugin import autocast, clipping, diagnostics
from amp_plugin.kernels import Backend, Kernels, check_backend, get_kernels
from amp_plugin.scaler import LossScaler, unwrap_optimizer

__all__ = ["CHECKPOINT_KEY", "AMPPrecision"]

CHECKPOINT_KEY = "amp_plugin"
# Where Lightning's MixedPrecision keeps its GradScaler state: its class name, and the pre-2.0 key.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")
_OBSERVING_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")
_SCHEDULER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class AMPPrecision(Precision):
    """Mixed precision for ``Trainer(plugins=[AMPPrecision(...)])``.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling, honoured on CPU too),
            ``"bf16-mixed"``, or ``"auto"`` (bf16 where the device supports it, else fp16).
        device: the autocast device type; ``None`` takes it from the model's device at setup.
        scaler: the :class:`LossScaler` for fp16; fp16 gets ``LossScaler()`` by default.
        kernels: kernel backend for the default scaler and for clipping.
        fp32_modules: module classes whose forward runs in fp32 with autocast off.
        clip_fused: ``"auto"`` takes the fast clipping path (norm and inf check on the
            still-scaled gradients, one combined multiply or a fold into a fused optimizer)
            unless the LightningModule or a callback overrides ``on_before_optimizer_step``
            or ``configure_gradient_clipping``; ``True`` always takes it (those hooks then see
            scaled gradients); ``False`` unscales before the hooks, as Lightning does.
        lr_on_skip: ``"hold"`` keeps step-interval LR schedulers still on a skipped step;
            ``"advance"`` steps them anyway (without PyTorch's misleading order warning).

    Example:
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> plugin.precision, plugin.dtype, type(plugin.scaler).__name__
        ('16-mixed', torch.float16, 'LossScaler')
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "auto"] = "auto",
        device: str | None = None,
        scaler: LossScaler | None = None,
        kernels: Backend = "auto",
        fp32_modules: Sequence[type[nn.Module]] = (),
        clip_fused: Literal["auto"] | bool = "auto",
        lr_on_skip: Literal["hold", "advance"] = "hold",
    ) -> None:
        _validate(precision, scaler, clip_fused, lr_on_skip)
        self.kernels = check_backend(kernels)
        self.fp32_modules = autocast.check_module_classes(fp32_modules)
        self.clip_fused = clip_fused
        self.lr_on_skip = lr_on_skip
        self.requested = precision
        self.scaler = scaler
        self.device: str | None = None
        self.dtype: torch.dtype | None = None
        self.precision = precision  # type: ignore[assignment]  # "auto" until resolved at setup
        self.last_grad_norm: Tensor | None = None  # unscaled, before clipping, when a clip computed it
        self._fp32_hooks: autocast.Fp32Modules | None = None
        self._fast_clip = clip_fused is True
        self._stepped_in_batch = False
        self._want_grad_norm = False
        if device is not None:
            self._resolve(device)

    # -- set-up ---------------------------------------------------------------------------------

    def _resolve(self, device: str) -> None:
        device_type = torch.device(device).type
        dtype = autocast.resolve_precision(self.requested, device_type)
        # A scaler comes only with "16-mixed" (_validate), which always resolves to fp16.
        if self.scaler is None and dtype == torch.float16:
            self.scaler = LossScaler(kernels=self.kernels)
        self.device, self.dtype = device_type, dtype
        self.precision = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
        if self.requested == "auto":
            rank_zero_info(
                f"AMPPrecision('auto') chose {self.precision}: {autocast.auto_precision_reason(device_type)}"
            )

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        if self.device is None:
            self._resolve(_module_device(model))
        module = _lightning_module(model)  # strategies hand over their wrapper (DDP, ...)
        self._check_setup(module, optimizers)
        if self._fp32_hooks is None and self.fp32_modules:
            self._fp32_hooks = autocast.force_fp32(module, self.fp32_modules)
        if isinstance(module, LightningModule) and module._trainer is not None:
            self._fast_clip = self.clip_fused is True or (
                self.clip_fused == "auto" and not _hooks_observe_gradients(module)
            )
            if module.automatic_optimization:
                for config in lr_schedulers:
                    if getattr(config, "interval", "step") == "step" and not isinstance(
                        config.scheduler, _SkipAwareScheduler
                    ):
                        config.scheduler = _SkipAwareScheduler(config.scheduler, self)
        return model, optimizers, lr_schedulers

    def _check_setup(self, model: nn.Module, optimizers: list[Optimizer]) -> None:
        assert self.dtype is not None and self.device is not None
        if self.scaler is not None and any(isinstance(unwrap_optimizer(o), LBFGS) for o in optimizers):
            raise ValueError(
                "AMPPrecision('16-mixed') cannot drive LBFGS: it evaluates its closure several times per "
                "step, which loss scaling cannot skip safely. HINT: use precision='bf16-mixed' or another "
                "optimizer."
            )
        findings = diagnostics.check_optimizer_setup(
            model,
            optimizers,
            device_type=self.device,
            dtype=self.dtype,
            grad_scaling=self.scaler is not None,
        )
        errors = [f.message for f in findings if f.severity == "error"]
        if errors:
            raise ValueError("AMPPrecision found problems at fit start:\n- " + "\n- ".join(errors))
        for finding in findings:
            rank_zero_warn(finding.message)
        if self.dtype == torch.bfloat16 and (names := autocast.find_data_parallel(model)):
            rank_zero_warn(
                f"{', '.join(names)} is a plain nn.DataParallel: its replica threads would run fp16, not "
                "bf16 (torch re-enters only 'autocast enabled' there). HINT: wrap with "
                "amp_plugin.AutocastDataParallel instead."
            )

    @override
    def teardown(self) -> None:
        if self._fp32_hooks is not None:
            self._fp32_hooks.remove()
            self._fp32_hooks = None

    # -- autocast -------------------------------------------------------------------------------

    def autocast_context_manager(self) -> torch.autocast:
        """The autocast context for forward passes (the weight-cast cache off, as in Lightning)."""
        if self.device is None:
            self._resolve("cuda" if torch.cuda.is_available() else "cpu")
        # cache_enabled=False: a weight cast cached under no_grad would carry no autograd history
        # into a later forward with grad in the same autocast region.
        return torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)  # type: ignore[arg-type]

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager():
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
        if self._stepped_in_batch and self.scaler is not None:
            self._stepped_in_batch = False
            self.scaler.update()

    # -- backward and step ----------------------------------------------------------------------

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # The hooks get the loss as the user computed it; only backward sees the scaled one.
        super().pre_backward(tensor, module)
        return tensor if self.scaler is None else self.scaler.scale(tensor)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)  # backward was skipped: nothing to unscale or step
            return closure_result
        stage = self.scaler.stage(optimizer)
        if stage == "stepped":
            raise RuntimeError(
                f"{type(unwrap_optimizer(optimizer)).__name__} was stepped twice in one training_step under "
                "fp16 loss scaling, which updates the scale once per batch. HINT: step each optimizer once "
                "per training_step, or accumulate gradients across batches instead."
            )
        if stage == "ready" and not self._fast_clip:
            self.scaler.unscale_(optimizer)  # the hooks below see unscaled gradients
        self._after_closure(model, optimizer)
        result = self.scaler.step(optimizer, **kwargs)
        if model.automatic_optimization:
            self.scaler.update()
        else:
            self._stepped_in_batch = True
        return result

    def request_grad_norm(self) -> None:
        """Have the next optimizer step record ``last_grad_norm`` even without clipping.

        With clipping on, the norm comes free with the clip; otherwise it costs one read of the
        gradients, which is why it is asked for per step (e.g. on logging steps only).
        """
        self._want_grad_norm = True

    @override
    def _after_closure(self, model: LightningModule, optimizer: Any) -> None:
        super()._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        if self._want_grad_norm and self.last_grad_norm is None:
            self.last_grad_norm = self._grad_norm(optimizer)
        self._want_grad_norm = False

    def _grad_norm(self, optimizer: Any) -> Tensor:
        if self.scaler is not None:
            return self.scaler.grad_norm(optimizer)
        grads = clipping.gradients(unwrap_optimizer(optimizer).param_groups)
        return self._kernels_for(grads).norm(grads)

    def _kernels_for(self, grads: list[Tensor]) -> Kernels:
        return get_kernels(self.kernels, grads[0].device if grads else None)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last update skipped its step (always ``False`` without a scaler)."""
        return self.scaler is not None and self.scaler.last_step_skipped

    # -- clipping -------------------------------------------------------------------------------

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.scaler is not None:
            self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, float(clip_val))
            return
        grads = clipping.gradients(unwrap_optimizer(optimizer).param_groups)
        self.last_grad_norm = clipping.clip_grad_norm_(
            self._kernels_for(grads), grads, float(clip_val)
        ).total_norm

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._want_grad_norm and self.last_grad_norm is None:  # the norm before clipping
            self.last_grad_norm = self._grad_norm(optimizer)
        if self.scaler is not None:
            self.scaler.clip_grad_value_(optimizer, float(clip_val))
        else:
            super().clip_grad_by_value(unwrap_optimizer(optimizer), clip_val)

    # -- checkpoints ----------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        # Lightning files a non-empty state_dict under this class's __qualname__, which a rename
        # or subclass would orphan; the state goes under CHECKPOINT_KEY in on_save_checkpoint.
        return {}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "precision": self.precision,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is not None:
            if not isinstance(entry, dict) or "scaler" not in entry:
                raise ValueError(
                    f"The checkpoint's {CHECKPOINT_KEY!r} entry is {type(entry).__name__} {entry!r:.80}; "
                    "expected a dict with a 'scaler' state. HINT: the checkpoint is corrupt or was "
                    "written by another program; resume without ckpt_path or fix the entry."
                )
            self.load_state_dict(entry["scaler"])
            return
        for key in _FOREIGN_KEYS:
            if key in checkpoint:
                self.load_state_dict(checkpoint[key])
                return

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state (from this plugin, ``LossScaler``, or ``torch.amp.GradScaler``)."""
        if self.scaler is None:
            if state_dict:
                rank_zero_warn(
                    "The checkpoint holds a loss-scaler state, but this run uses bf16 without a scaler; "
                    "the state is ignored."
                )
            return
        if not state_dict:
            rank_zero_warn(
                "The checkpoint holds no loss-scaler state (a bf16 run?); the scale starts afresh."
            )
            return
        self.scaler.load_state_dict(state_dict)


class _SkipAwareScheduler:
    """A step-interval LR scheduler that holds still when the optimizer step was skipped.

    Everything but ``step`` goes to the wrapped scheduler, so checkpoints, ``get_last_lr``
    and Lightning's LearningRateMonitor see the original object's state.
    """

    def __init__(self, scheduler: Any, plugin: AMPPrecision) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_plugin"] = plugin

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._plugin.last_step_skipped:
            self._scheduler.step(*args, **kwargs)
            return
        if self._plugin.lr_on_skip == "hold":
            return
        with warnings.catch_warnings():  # the skip is why optimizer.step() never ran
            warnings.filterwarnings("ignore", message=_SCHEDULER_WARNING)
            self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper, or ``model`` itself."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        if isinstance(model, LightningModule) or not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _module_device(model: nn.Module) -> str:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device.type
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _hooks_observe_gradients(model: LightningModule) -> bool:
    """Whether the module or a callback can look at gradients between backward and step."""
    if any(_overrides(type(model), LightningModule, hook) for hook in _OBSERVING_HOOKS):
        return True
    callbacks = getattr(model.trainer, "callbacks", [])
    return any(_overrides(type(cb), Callback, "on_before_optimizer_step") for cb in callbacks)


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is not getattr(base, name, None)


def _validate(precision: object, scaler: object, clip_fused: object, lr_on_skip: object) -> None:
    autocast.check_precision(precision)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(
            f"AMPPrecision(scaler=...) takes an amp_plugin.LossScaler, got {type(scaler).__qualname__}. "
            "HINT: LossScaler accepts torch.amp.GradScaler's arguments and loads its state_dict."
        )
    if scaler is not None and precision == "bf16-mixed":
        raise ValueError(
            "AMPPrecision(precision='bf16-mixed') does not use a loss scaler, but scaler= was passed. "
            "HINT: drop scaler=, or use precision='16-mixed'."
        )
    if scaler is not None and precision == "auto":
        raise ValueError(
            "AMPPrecision(precision='auto', scaler=...) is ambiguous: 'auto' picks bf16 (no scaler) where it "
            "can. HINT: pass precision='16-mixed' together with the scaler."
        )
    if clip_fused not in ("auto", True, False):
        raise ValueError(
            f"AMPPrecision(clip_fused={clip_fused!r}): allowed 'auto', True, False. HINT: use 'auto'."
        )
    if lr_on_skip not in ("hold", "advance"):
        raise ValueError(
            f"AMPPrecision(lr_on_skip={lr_on_skip!r}): allowed 'hold', 'advance'. HINT: use 'hold'."
        )
