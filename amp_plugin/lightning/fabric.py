"""``AMPPrecision`` for Lightning Fabric: ``Fabric(plugins=[AMPPrecision("16-mixed")])``.

The same name as the Trainer's plugin (``amp_plugin.AMPPrecision``), as Lightning names its own
``MixedPrecision`` in both packages. Importing this module imports Lightning (``import
amp_plugin`` does not).

A Fabric ``MixedPrecision`` driving a :class:`~amp_plugin.LossScaler` instead of a
``torch.amp.GradScaler``, through the same step driver as the Trainer's
plugin: steps with an inf/NaN loss or gradient are skipped in every precision (on every DDP rank
alike, since the scaler or guard agrees on its inf flag across the default process group), and
``fabric.clip_gradients`` clips the unscaled gradients, of fused optimizers too. The Trainer
plugin's half-precision weights come along: fp32 master weights (Apex's O2), the "-true"
precisions with stochastic or Kahan rounding, a
scheduler that holds on a skipped step (:meth:`AMPPrecision.skip_aware`), and the ``amp/*``
values for ``fabric.log_dict`` (:meth:`AMPPrecision.metrics`).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from amp_plugin._fit_start import LBFGS_REFUSAL, is_lbfgs
from amp_plugin._optim import unwrap_optimizer
from amp_plugin._run import AMPRun, RunOptions
from amp_plugin._scaler import LossScaler
from amp_plugin._schedulers import SkipAwareScheduler
from amp_plugin._validation import check_tensor_scalar, fail, is_number
from amp_plugin.lightning import _compat
from amp_plugin.lightning._opt_levels import opt_level_arguments
from amp_plugin.lightning._run_view import RunView
from amp_plugin.precision import Precision as PrecisionName

__all__ = ["AMPPrecision"]


class AMPPrecision(RunView, MixedPrecision):  # type: ignore[misc]  # scaler: a LossScaler property
    """Mixed precision for ``Fabric(plugins=[AMPPrecision(...)])``, with amp_plugin's loss scaler.

    The arguments are the Trainer plugin's (:class:`amp_plugin.AMPPrecision`): both hand them to one
    core, which checks them and builds the run.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling, honoured on CPU too),
            ``"bf16-mixed"``, ``"auto"`` (bf16 where the device supports it, else fp16),
            ``"16-true"`` / ``"bf16-true"`` (the weights themselves in fp16/bf16, no fp32 copy;
            fp16 keeps loss scaling; tensors made under ``fabric.init_module()`` and in forward
            passes take that dtype, as with Fabric's own ``"-true"``), or ``"32-true"`` (fp32,
            autocast off, still guarded).
        device: the autocast device type; ``None`` takes ``"cuda"`` where CUDA is available, else
            ``"cpu"`` (pass ``device="cpu"`` for ``Fabric(accelerator="cpu")`` on a GPU machine).
        scaler: the :class:`LossScaler` for fp16 (a ``torch.amp.GradScaler`` is converted with its
            settings and state); fp16 gets ``LossScaler()`` by default.
        **options: keyword-only, as for the Trainer's plugin: ``kernels``, ``fp32_modules``,
            ``fp32_functions``, ``clip_fused``, ``lr_on_skip``, ``master_weights``, ``keep_fp32``,
            ``rounding``, ``rounding_seed``, ``guard``, ``fp8``, ``fp32_grad_accumulation``,
            ``spike_guard``; each is described in :class:`~amp_plugin.RunOptions`. Under Fabric,
            ``lr_on_skip`` acts on schedulers wrapped by :meth:`skip_aware`; ``fp8`` converts the
            layers in ``fabric.setup(model)`` (:attr:`fp8_report` says which). Two ask for what only
            the Trainer does: ``clip_fused=True`` (``fabric.clip_gradients`` unscales before it
            clips) and ``fp32_grad_accumulation=True`` (Fabric does not say how many backward passes
            a step takes) are refused with a ``ValueError``; ``False`` is what Fabric does anyway.

    ``fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})`` stores the
    scaler (or guard) state and the rounding generators (Fabric saves what it is handed, and it
    does not hand over the precision plugin by itself); ``fabric.load`` with the same keys
    restores them.

    Example:
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> plugin.precision, plugin.dtype, type(plugin.scaler).__name__
        ('16-mixed', torch.float16, 'LossScaler')
        >>> plugin
        amp_plugin.lightning.fabric.AMPPrecision('16-mixed')
    """

    def __init__(  # MixedPrecision.__init__ is not called: it takes only "-mixed" and builds a GradScaler
        self,
        precision: PrecisionName = "auto",
        device: str | None = None,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        **options: Unpack[RunOptions],
    ) -> None:
        for name, why in _TRAINER_ONLY.items():
            if options.get(name) is True:
                fail(
                    "AMPPrecision",
                    passed=f"{name}=True",
                    why=why,
                    allowed=f"{name}=True with the Trainer's amp_plugin.AMPPrecision only",
                    hint=f"drop {name}=True: Fabric's plugin takes every other option as the Trainer's does.",
                )
        fallback = "cuda" if torch.cuda.is_available() else "cpu"
        device = fallback if device is None else device
        self._run = AMPRun(precision, device, scaler, say=_say, **options)
        _compat.set_fabric_input_dtype(self, self._run.settings(device)[1])  # ThroughputMonitor reads it
        self._module: weakref.ref[nn.Module] | None = None  # the model convert_module was handed
        self._models: list[weakref.ref[nn.Module]] = []  # every model set up (a GAN has two)
        self._attached: set[int] = set()  # id() of the optimizers checked and handed to the half weights
        self._replaced: dict[Tensor, Tensor] = {}  # parameters the fp8 conversion replaced -> the new ones

    @classmethod
    def from_opt_level(cls, level: Literal["O0", "O1", "O2", "O3"], **overrides: Any) -> AMPPrecision:
        """The plugin for Apex opt level ``level``, as the Trainer's ``AMPPrecision.from_opt_level``.

        O0 is fp32, O1 autocast with dynamic loss scaling, O2 an fp16 model with fp32 norms and
        master weights, O3 pure fp16 (static loss scale 1.0, as in Apex); ``overrides`` take Apex's
        or this class's keywords (Apex's: ``cast_model_type``, ``keep_batchnorm_fp32``,
        ``loss_scale``, ``min_loss_scale``, ``max_loss_scale``).

        Example:
            >>> plugin = AMPPrecision.from_opt_level("O2", device="cpu")
            >>> plugin.precision, plugin.master_weights
            ('16-mixed', True)
        """
        return cls(**opt_level_arguments(level, **overrides))

    def __repr__(self) -> str:
        return f"amp_plugin.lightning.fabric.AMPPrecision({self.requested!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Fabric(strategy="ddp_spawn") pickles the plugin into every process. Weak references do not
        # pickle: the models set up go as strong ones (a spawn pickles them alongside, so they are
        # shared, not copied twice), and ids of optimizers mean nothing in another process.
        state = dict(self.__dict__)
        state["_module"] = None if self._module is None else self._module()
        state["_models"] = [m for ref in self._models if (m := ref()) is not None]
        state["_attached"] = set()  # a copy re-attaches each optimizer at its first step
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        module, models = state.pop("_module"), state.pop("_models")
        self.__dict__.update(state)
        self._module = None if module is None else weakref.ref(module)
        self._models = [weakref.ref(m) for m in models]

    def __str__(self) -> str:
        # Lightning's Trainer names a plugin it refuses by str(): say which plugin a Trainer takes.
        return f"{self!r} (Lightning Fabric's plugin; Trainer(plugins=[...]) takes amp_plugin.AMPPrecision)"

    # -- dtypes: autocast, and the default dtype of the "-true" precisions -------------------------

    @override
    def tensor_init_context(self) -> AbstractContextManager[None]:
        """Under "16-true"/"bf16-true", tensors made inside take the half dtype (Fabric's ``HalfPrecision``).

        Example:
            >>> with AMPPrecision("bf16-true", device="cpu").tensor_init_context():
            ...     torch.ones(2).dtype
            torch.bfloat16
            >>> torch.get_default_dtype()
            torch.float32
        """
        return self._run.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager[None]:
        """:meth:`tensor_init_context`: ``fabric.init_module()`` builds "-true" models in half directly.

        With master weights the model is built in fp32: the masters are made from those values.
        """
        return self.tensor_init_context()

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """Autocast for the forward pass (off for "32-true"); "-true" also switches the default dtype.

        A ``torch.autocast`` itself (as Fabric's ``MixedPrecision`` returns), except under "-true",
        where the default dtype switches with it.

        Example:
            >>> isinstance(AMPPrecision("bf16-mixed", device="cpu").forward_context(), torch.autocast)
            True
        """
        return self._run.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs take the autocast or weight dtype (left alone under "32-true")."""
        if self.dtype == torch.float32:
            return data
        return apply_to_collection(data, Tensor, _to_dtype, self.dtype)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the model's weights to fp16/bf16 for master weights or a "-true" precision, in place.

        ``fabric.setup`` calls this before it wraps the model, so the masters are made from the
        values the model holds (fp32 ones are not rounded).
        """
        self._refuse_second_model(module)
        before = dict(module.named_parameters()) if self.fp8 is not None else {}
        report = self._run.convert(module, self.device)  # the half weights, or the fp8 layers
        self._module = weakref.ref(module)
        if all(ref() is not module for ref in self._models):
            self._models.append(weakref.ref(module))
        if report is not None:  # before the fp32 hooks: a failed conversion leaves none behind
            # torchao's fp8 all-gather wraps each converted weight in a new Parameter, and the
            # optimizers handed to fabric.setup were built on the old ones: attach re-points them.
            self._replaced.update(
                (before[n], p) for n, p in module.named_parameters() if n in before and before[n] is not p
            )
            rank_zero_info(f"AMPPrecision (Fabric): {report}")
        self._run.force_fp32(module)
        return module

    def _refuse_second_model(self, module: nn.Module) -> None:
        first = None if self._module is None else self._module()
        if not self.master_weights or first is None or first is module:
            return
        fail(
            "AMPPrecision(master_weights=True)",
            passed=f"a second model ({type(module).__name__}) to fabric.setup",
            why="this plugin keeps fp32 masters for one model only",
            allowed=f"one model per plugin: the fp32 masters belong to the first ({type(first).__name__})",
            hint=(
                "set up the models as one module, e.g. fabric.setup(nn.ModuleDict({'g': g, 'd': d}), "
                "opt_g, opt_d), and call them inside `with fabric.autocast():`; or use a '-true' "
                "precision (rounding='stochastic' or 'kahan'), which keeps no masters."
            ),
        )

    # -- the optimizers ----------------------------------------------------------------------------

    def attach(self, *optimizers: Any) -> None:
        """Check ``optimizers`` as the Trainer plugin does at fit start; hand them to the half weights.

        With master weights the optimizer then steps the fp32 masters; with a rounding its steps
        are rounded into the half weights. Refused (``ValueError``, nothing changed) is what the
        Trainer refuses at fit start: LBFGS under loss scaling, an ``eps`` that fp16 rounds to
        zero under "16-true", a half parameter without a master. Each optimizer is attached at
        its first ``step()`` or ``fabric.clip_gradients`` by itself; call this after
        ``fabric.setup`` and before ``fabric.load`` restores an optimizer's state with master
        weights: loaded into the half parameters, the state would be rounded to half.

        Example:
            >>> plugin = AMPPrecision("bf16-mixed", master_weights=True, device="cpu")
            >>> model = plugin.convert_module(nn.Linear(2, 2))  # what fabric.setup does
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> plugin.attach(opt)
            >>> model.weight.dtype, opt.param_groups[0]["params"][0].dtype
            (torch.bfloat16, torch.float32)
        """
        for optimizer in optimizers:
            opt = unwrap_optimizer(optimizer)
            if id(opt) in self._attached:
                continue
            _repoint(opt, self._replaced)
            module = self._model_of(opt)
            if module is None and self._run.half is not None:
                fail(
                    "AMPPrecision.attach",
                    passed=f"optimizer={type(opt).__name__} before the model was set up",
                    why="the model is not set up yet",
                    allowed="attaching optimizers once fabric.setup(model, ...) has cast the model",
                    hint="call precision.attach(optimizer) after fabric.setup.",
                    error=RuntimeError,
                )
            if self._run.half is not None:
                self._refuse_early_state(opt)
            self._run.attach(module, [opt])
            self._attached.add(id(opt))

    def _model_of(self, opt: Optimizer) -> nn.Module | None:
        """The model(s) set up whose parameters ``opt`` steps (the latest model if none)."""
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        models = [m for ref in self._models if (m := ref()) is not None]
        owners = [m for m in models if any(id(p) in params for p in m.parameters())]
        if len(owners) > 1:  # one optimizer for several models: check it against all of them
            return nn.ModuleList(owners)
        return owners[0] if owners else None if self._module is None else self._module()

    def _refuse_early_state(self, opt: Optimizer) -> None:
        masters = self.masters
        if masters is None or not any(
            masters.master_of(p) is not None
            and any(
                isinstance(v, Tensor) and v.dim() > 0 and v.dtype == p.dtype for v in opt.state[p].values()
            )
            for group in opt.param_groups
            for p in group["params"]
            if p in opt.state
        ):  # state in fp32 (handed back by teardown) goes to the masters as it is
            return
        fail(
            "AMPPrecision(master_weights=True).attach",
            passed=f"optimizer={type(opt).__name__} with state for the model's half parameters",
            why="the optimizer already has state for the half parameters",
            allowed=(
                "an optimizer without state until it steps the fp32 masters (state loaded by fabric.load "
                f"into the half parameters was rounded to {self.dtype})"
            ),
            hint="call precision.attach(optimizer) after fabric.setup and before fabric.load.",
            error=RuntimeError,
        )

    # -- backward and step -------------------------------------------------------------------------

    @override
    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        # Scaled for fp16; a non-finite loss makes the gradients NaN.
        self._run.require_driver().backward(tensor, _tensor_backward, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless the loss or a gradient is inf/NaN (weights, masters and optimizer state then stay put).

        Every precision is checked (see :attr:`guard`); the scale is updated after the step.
        """
        if is_lbfgs(optimizer):
            if self.scaler is not None:
                raise TypeError(LBFGS_REFUSAL)
            if self._run.half is None:  # LBFGS runs its closure itself, several times per step
                self.attach(optimizer)
                return optimizer.step(**kwargs)
        self.attach(optimizer)
        # fabric.clip_gradients (the only thing between backward and step) has unscaled already.
        driver = self._run.require_driver()
        return driver.step(optimizer, lambda: False, observe_unscaled=False, hooks_read=False, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients in place (and check them) before ``fabric.clip_gradients`` clips them.

        Also for fused optimizers (``fused=True``), which then step on the unscaled gradients;
        a second clip in the same step finds them unscaled already. With master weights the
        gradients move into the fp32 masters first, and the masters' gradients are clipped.
        """
        self.attach(optimizer)
        if self._run.half is not None:  # the clip that follows acts on fp32 gradients
            self._run.half.before_step(unwrap_optimizer(optimizer))
            self._run.half.grads_in_fp32(unwrap_optimizer(optimizer))
        guard = self._run.require_driver().scaler
        if guard is not None and guard.stage(optimizer) == "ready":
            guard.unscale_(optimizer)

    # -- what a Fabric loop reads ------------------------------------------------------------------

    def skip_aware(self, scheduler: Any) -> SkipAwareScheduler:
        """``scheduler`` wrapped to follow ``lr_on_skip`` when the optimizer step it follows was skipped.

        Step the wrapper once per ``optimizer.step()``, as you would the scheduler; with
        ``lr_on_skip="hold"`` it stays put after a skipped step, so the schedule counts the steps
        the weights took. Everything else (``get_last_lr``, ``state_dict``) is the scheduler's.

        Example:
            >>> plugin = AMPPrecision("bf16-mixed", device="cpu")
            >>> opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
            >>> scheduler = plugin.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
            >>> scheduler.get_last_lr()
            [1.0]
        """
        return SkipAwareScheduler(scheduler, self._run.require_driver(), self.lr_on_skip)

    def metrics(self, grad_norm: Tensor | float | None = None) -> dict[str, float]:
        """The ``amp/*`` values as Python floats, ready for ``fabric.log_dict(precision.metrics())``.

        ``amp/scale`` (fp16's loss scale), ``amp/skipped_steps``, ``amp/skip_rate`` (skipped steps
        over all steps of the run), and ``amp/grad_norm`` when ``grad_norm`` is passed (the
        unscaled norm ``fabric.clip_gradients`` returned: NaN or inf on a step with such a gradient). The
        Trainer's ``LossScaleMonitor`` logs the same keys (its skip rate over a recent window).
        It reads the scale and the skip count from the device (a sync on CUDA): call it on logging steps.

        Example:
            >>> AMPPrecision("16-mixed", device="cpu").metrics(grad_norm=0.5)
            {'amp/scale': 65536.0, 'amp/skipped_steps': 0.0, 'amp/skip_rate': 0.0, 'amp/grad_norm': 0.5}
        """
        hint = "pass what fabric.clip_gradients returned (or nothing)."
        if isinstance(grad_norm, Tensor):
            check_tensor_scalar("AMPPrecision.metrics", "grad_norm", grad_norm, hint)
        elif grad_norm is not None and not is_number(grad_norm) and not isinstance(grad_norm, float):
            fail(
                "AMPPrecision.metrics",
                passed=f"grad_norm={grad_norm!r:.80}",
                allowed="None, a number or a one-element tensor",
                hint=hint,
                error=TypeError,
            )
        return self._run.metrics(None if grad_norm is None else float(grad_norm))

    # -- checkpoints -------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (what Fabric's ``MixedPrecision`` saves) or the guard's, and the rounding's.

        Example:
            >>> sorted(AMPPrecision("bf16-true", rounding="stochastic", device="cpu").state_dict())
            ['guard']
        """
        return self._run.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s result, or the state of Fabric's ``MixedPrecision`` (a GradScaler's).

        Everything is checked before anything changes. A state saved in another precision warns, as
        in the Trainer: an fp16 scale in a run without a scaler is ignored, and an fp16 run resumed
        from a state without one starts its scale afresh.
        """
        self._run.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        self._attached.clear()
        self._run.teardown()


_TRAINER_ONLY = {  # options that ask for something only the Trainer can do
    "clip_fused": "fabric.clip_gradients unscales the gradients before it clips them: there is no fused clip",
    "fp32_grad_accumulation": (
        "Fabric does not say how many backward passes an optimizer step takes, so micro-batch gradients "
        "add up in the half .grad"
    ),
}


def _say(message: str, warn: bool) -> None:
    (rank_zero_warn if warn else rank_zero_info)(message)


def _repoint(opt: Optimizer, replaced: dict[Tensor, Tensor]) -> None:
    """Let ``opt`` step the parameters that replaced the ones it was built on (state included)."""
    if not replaced:
        return
    for group in opt.param_groups:
        group["params"] = [replaced.get(p, p) for p in group["params"]]
    for old in [p for p in opt.state if p in replaced]:
        opt.state[replaced[old]] = opt.state.pop(old)


def _to_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _tensor_backward(tensor: Tensor, *args: Any, **kwargs: Any) -> None:
    """What Fabric's ``Precision.backward`` does."""
    tensor.backward(*args, **kwargs)
