"""``AMPPrecision``: Lightning's precision hooks, each handed to the run's plain-torch core.

A thin adapter: :class:`~amp_plugin._run.AMPRun` checks the arguments, builds the scaler or the
guard, owns the half weights and the fp32 policies, and checks the model and optimizers at fit
start (:mod:`amp_plugin._fit_start`); its step driver orders each optimizer step. Its neighbours in
:mod:`amp_plugin.lightning` hold the rest: what the Trainer's model reveals (``_checks``), the
checkpoint entry (``_checkpoint``), and every read of a Lightning internal (``_compat``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from amp_plugin._fit_start import is_lbfgs, module_device
from amp_plugin._run import AMPRun, RunOptions
from amp_plugin._scaler import LossScaler
from amp_plugin._schedulers import hold_step_schedulers
from amp_plugin._validation import fail
from amp_plugin.lightning import _checkpoint as checkpoints
from amp_plugin.lightning import _checks as checks
from amp_plugin.lightning import _compat
from amp_plugin.lightning._opt_levels import opt_level_arguments
from amp_plugin.lightning._run_view import RunView
from amp_plugin.precision import Precision as PrecisionName

__all__ = ["AMPPrecision"]


class AMPPrecision(RunView, MixedPrecision):  # type: ignore[misc]  # scaler: a LossScaler property
    """Mixed precision for ``Trainer(plugins=[AMPPrecision(...)])``.

    A :class:`~lightning.pytorch.plugins.precision.MixedPrecision` to Lightning (its
    ThroughputMonitor and checkpoint code treat it as one), driving a :class:`LossScaler`.
    Fabric's :class:`amp_plugin.lightning.fabric.AMPPrecision` takes the same arguments: both hand them to
    one core, which checks them and builds the run.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling, honoured on CPU too),
            ``"bf16-mixed"``, ``"auto"`` (bf16 where the device supports it, else fp16),
            ``"16-true"`` / ``"bf16-true"`` (the weights themselves in fp16/bf16, no fp32 copy;
            fp16 keeps loss scaling; forward passes still run under autocast), or ``"32-true"``
            (fp32, autocast off: Apex's O0). See :meth:`from_opt_level` for Apex's ladder.
        device: the autocast device type; ``None`` takes it from the model's device at setup.
        scaler: the :class:`LossScaler` for fp16 (a ``torch.amp.GradScaler`` is converted with its
            settings and state); fp16 gets ``LossScaler()`` by default.
        **options: keyword-only: ``kernels``, ``fp32_modules``, ``fp32_functions``, ``clip_fused``,
            ``lr_on_skip``, ``master_weights``, ``keep_fp32``, ``rounding``, ``rounding_seed``,
            ``guard``, ``fp8``, ``fp32_grad_accumulation``, ``spike_guard``; each is described in
            :class:`~amp_plugin.RunOptions`. Under the Trainer, ``clip_fused="auto"`` takes the
            fast clipping path unless the LightningModule or a callback overrides
            ``on_before_optimizer_step`` or ``configure_gradient_clipping``; ``lr_on_skip`` acts on
            step-interval schedulers (in manual optimization declare them with
            ``"interval": "step"``); ``fp32_grad_accumulation`` acts where
            ``Trainer(accumulate_grad_batches > 1)`` runs on one device or under DDP (under the
            other strategies, and DDP with ``gradient_as_bucket_view`` or a comm hook of its own,
            it is off, with a warning).

    Example:
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> plugin.precision, plugin.dtype, type(plugin.scaler).__name__
        ('16-mixed', torch.float16, 'LossScaler')
    """

    def __init__(  # MixedPrecision.__init__ is not called: it would build a torch GradScaler
        self,
        precision: PrecisionName = "auto",
        device: str | None = None,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        **options: Unpack[RunOptions],
    ) -> None:
        self._run = AMPRun(precision, device, scaler, say=_say, **options)
        self._fast_clip = self._run.clip_fused is True
        self._hooks_read = True  # a hook may read gradient values (known once a Trainer connects)
        self._no_clip = False  # training_step returned None: the hooks run, nothing clips
        self._norm_asked = False  # request_grad_norm() before the precision (and its driver) resolved

    def __repr__(self) -> str:
        # Lightning names a plugin it refuses ("Received both `precision=...` and `plugins=...`") by str().
        return f"amp_plugin.AMPPrecision({self.requested!r})"

    @classmethod
    def from_opt_level(cls, level: Literal["O0", "O1", "O2", "O3"], **overrides: Any) -> AMPPrecision:
        """The plugin for Apex opt level ``level``; ``overrides`` take Apex's or this class's keywords.

        O0 is fp32, O1 autocast with dynamic loss scaling, O2 an fp16 model with fp32 norms and
        master weights, O3 pure fp16 (static loss scale 1.0, as in Apex). Apex's keywords:
        ``cast_model_type``, ``keep_batchnorm_fp32``, ``loss_scale``, ``min_loss_scale``,
        ``max_loss_scale``.

        Example:
            >>> plugin = AMPPrecision.from_opt_level("O2", device="cpu")
            >>> plugin.precision, plugin.master_weights
            ('16-mixed', True)
            >>> AMPPrecision.from_opt_level("O2", cast_model_type=torch.bfloat16).requested
            'bf16-mixed'
        """
        return cls(**opt_level_arguments(level, **overrides))

    # -- set-up ---------------------------------------------------------------------------------

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the model's weights to fp16/bf16 for master weights or a "-true" precision.

        Strategies call this before moving the model, wrapping it (DDP) and building its
        optimizers; so the masters are made from the original fp32 values.
        """
        if _compat.called_by_fabric():  # Fabric's setup: the wrong one of the two AMPPrecision classes
            raise TypeError(_IN_FABRIC.format(self=self))
        trainer = _compat.attached_trainer(module) if isinstance(module, LightningModule) else None
        device = trainer.strategy.root_device if trainer is not None else module_device(module)
        self._run.convert(module, device)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """With half weights, floating-point inputs take the weights' dtype (as in Lightning's "-true")."""
        if self._run.half is None or self.dtype is None:
            return data
        return apply_to_collection(data, Tensor, _to_dtype, self.dtype)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        run = self._run
        module = checks.lightning_module(model)  # strategies hand over their wrapper (DDP, ...)
        run.attach(module, optimizers)
        if run.half is not None:
            accumulate, ddp = self._accumulates_in_fp32(model, module)
            try:
                run.half.accumulate_in_fp32(accumulate, ddp)
            except RuntimeError:  # DDP takes one comm hook, and this model has one (ddp_comm_hook=)
                strategy = f"{type(model).__name__} with a comm hook"
                rank_zero_warn(_NO_FP32_ACCUMULATION.format(strategy=strategy))
        if self.fp8_report is not None:
            rank_zero_info(f"AMPPrecision: {self.fp8_report}")
        run.force_fp32(module)
        if isinstance(module, LightningModule) and (trainer := _compat.attached_trainer(module)) is not None:
            self._hooks_read = checks.hooks_observe_gradients(module, trainer)
            self._fast_clip = self.clip_fused is True or (self.clip_fused == "auto" and not self._hooks_read)
        hold_step_schedulers(lr_schedulers, run.require_driver(), self.lr_on_skip)
        if self._norm_asked:  # asked before fit: the driver exists now
            self._norm_asked = False
            run.require_driver().request_grad_norm()
        return model, optimizers, lr_schedulers

    def _accumulates_in_fp32(self, model: nn.Module, module: nn.Module) -> tuple[bool, Any]:
        """Whether this fit adds micro-batches up in fp32, and the DDP model that averages the sums.

        Asked for and accumulating, on one device or under DDP (whose bucket all-reduce then
        averages the fp32 sums); off with a warning under other strategies, or where DDP's
        ``.grad`` is its own bucket (``gradient_as_bucket_view``).
        """
        trainer = _compat.attached_trainer(module) if isinstance(module, LightningModule) else None
        if not self.fp32_grad_accumulation or trainer is None or trainer.accumulate_grad_batches <= 1:
            return False, None
        if isinstance(trainer.strategy, SingleDeviceStrategy):
            return True, None
        ddp = model if isinstance(model, DistributedDataParallel) else None
        if ddp is not None and not ddp.gradient_as_bucket_view:
            return True, ddp
        rank_zero_warn(_NO_FP32_ACCUMULATION.format(strategy=type(trainer.strategy).__name__))
        return False, None

    @override
    def teardown(self) -> None:
        self._run.teardown()

    # -- autocast -------------------------------------------------------------------------------

    @override
    def autocast_context_manager(self) -> torch.autocast:
        """The autocast context for forward passes (the weight-cast cache off, as in Lightning)."""
        return self._run.autocast()

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """With "-true", tensors and layers are created in the half dtype (Lightning's ``HalfPrecision``)."""
        return self._run.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self._run.tensor_init_context()

    @override
    def forward_context(self) -> AbstractContextManager[Any]:  # type: ignore[override]
        """Autocast for every step (training, validation, test, predict); inside it, the fp32 functions.

        With "-true", tensors created in the step take the half dtype too.
        """
        return self._run.forward_context()

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # Once per batch, before any clip: a manual clip_gradients() records the norm that
        # optimizer_step must not forget.
        if self._run.driver is not None:
            self._run.driver.begin_batch()
        with self.forward_context():
            yield
        # Manual optimization: one update per training batch, after every optimizer's step.
        if self._run.driver is not None:
            self._run.driver.end_batch()

    # -- backward and step ----------------------------------------------------------------------

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # The hooks get the loss as the user computed it; backward scales it.
        _compat.before_backward_hooks(self, tensor, module)
        return tensor

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        driver = self._run.require_driver()
        # model.backward is what Precision.backward calls. torch runs backward best with autocast off;
        # manual_backward sits inside training_step's region (automatic optimization calls backward
        # outside it, where there is nothing to turn off).
        seedable = checks.backward_takes_gradient(model)
        device = self._run.device or "cpu"
        if not torch.is_autocast_enabled(device):
            driver.backward(tensor, model.backward, *args, seedable=seedable, **kwargs)
            return
        with torch.autocast(device, enabled=False):
            driver.backward(tensor, model.backward, *args, seedable=seedable, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        driver, half = self._run.require_driver(), self._run.half
        if self.scaler is None and half is None and is_lbfgs(optimizer):
            # LBFGS runs its closure itself, several times per step (Lightning's Precision path).
            return super(MixedPrecision, self).optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()  # the half gradients must exist before the masters take them
        if closure_result is None and model.automatic_optimization:
            if half is not None:  # the hooks and the next zero_grad see the sums, as without it
                half.flush_gradients(optimizer)
            self._no_clip = True
            try:
                driver.not_stepped(optimizer, lambda: _compat.after_closure(self, model, optimizer))
            finally:
                self._no_clip = False
            return closure_result
        return driver.step(
            optimizer,
            lambda: _compat.after_closure(self, model, optimizer),  # the hooks, then clipping, as Lightning
            observe_unscaled=not self._fast_clip,
            hooks_read=self._hooks_read,
            update=model.automatic_optimization,
            **kwargs,
        )

    # -- checkpoints ----------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        # Lightning files a non-empty state_dict under this class's __qualname__, which a rename
        # or subclass would orphan; the state goes under CHECKPOINT_KEY in on_save_checkpoint.
        return {}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.save(checkpoint, self._run)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._run.load_state_dict(checkpoints.run_state_of(checkpoint), checkpoint.get("state_dict"))

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
        if not isinstance(checkpoint, dict):
            fail(
                "AMPPrecision.check_checkpoint",
                passed=f"checkpoint={type(checkpoint).__name__}",
                allowed="the checkpoint dict (what torch.load of a Lightning .ckpt gives)",
                hint="pass the dict LightningModule.on_load_checkpoint receives.",
                error=TypeError,
            )
        self._run.check_state_dict(checkpoints.run_state_of(checkpoint), checkpoint.get("state_dict"))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state (from this plugin, ``LossScaler``, or ``torch.amp.GradScaler``)."""
        checkpoints.load_scaler_state(self.scaler, state_dict)

    # -- clipping and the gradient norm ----------------------------------------------------------

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The unscaled total gradient norm before clipping, of this batch's latest step, or ``None``.

        What a norm clip computed, or what :meth:`request_grad_norm` asked for (the step driver's).
        """
        driver = self._run.driver
        return None if driver is None else driver.last_grad_norm

    def request_grad_norm(self) -> None:
        """Have the next optimizer step record ``last_grad_norm`` even without clipping.

        With clipping on, the norm comes free with the clip; otherwise it costs one read of the
        gradients, which is why it is asked for per step (e.g. on logging steps only).
        """
        driver = self._run.driver
        if driver is None:  # before fit: resolving now could pick another device than the model's
            self._norm_asked = True
        else:
            driver.request_grad_norm()

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
        self._run.require_driver().clip_grad_norm_(optimizer, float(clip_val))  # keeps last_grad_norm

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._run.require_driver().clip_grad_value_(optimizer, float(clip_val))


_NO_FP32_ACCUMULATION = (
    "AMPPrecision: fp32 gradient accumulation is off under {strategy} (it runs on one device, and "
    "under DDP without gradient_as_bucket_view or a comm hook of its own); micro-batch gradients add "
    "up in the half-precision .grad, rounding each sum. "
    "HINT: pass AMPPrecision(fp32_grad_accumulation=False) to silence this, or use fewer, larger "
    "micro-batches."
)

def _say(message: str, warn: bool) -> None:
    (rank_zero_warn if warn else rank_zero_info)(message)


_IN_FABRIC = (
    "Fabric(plugins=[amp_plugin.AMPPrecision({self.requested!r})]) is not allowed here: that is the "
    "Trainer's plugin. Allowed: amp_plugin.lightning.fabric.AMPPrecision (the same arguments). "
    "HINT: from amp_plugin.lightning.fabric import AMPPrecision"
)


def _to_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
