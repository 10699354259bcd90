"""``AMPPrecision`` for Lightning Fabric: ``Fabric(plugins=[AMPPrecision("16-mixed")])``.

The same name as the Trainer's plugin (``amp_plugin.AMPPrecision``), as Lightning names its own
``MixedPrecision`` in both packages. Importing this module imports Lightning (``import
amp_plugin`` does not).

A Fabric ``MixedPrecision`` driving a :class:`~amp_plugin.LossScaler` instead of a
``torch.amp.GradScaler``: steps with an inf/NaN loss or gradient are skipped in every precision (on
every DDP rank alike, since the scaler or guard agrees on its inf flag across the default process
group), and ``fabric.clip_gradients``
clips the unscaled gradients, of fused optimizers too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin import fp8 as fp8_layers
from amp_plugin import fp32_policy
from amp_plugin._validation import check_choice
from amp_plugin.fp8 import Float8, Float8Report, Recipe, check_fp8_request
from amp_plugin.kernels import Backend, check_backend
from amp_plugin.lightning import checks
from amp_plugin.scaler import LossScaler
from amp_plugin.step import StepDriver

__all__ = ["AMPPrecision"]


class AMPPrecision(MixedPrecision):
    """Mixed precision for ``Fabric(plugins=[AMPPrecision(...)])``, with amp_plugin's loss scaler.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling, honoured on CPU too),
            ``"bf16-mixed"``, or ``"auto"`` (bf16 where the device supports it, else fp16).
        device: the autocast device type; ``None`` takes ``"cuda"`` where CUDA is available, else
            ``"cpu"`` (pass ``device="cpu"`` for ``Fabric(accelerator="cpu")`` on a GPU machine).
        scaler: the :class:`LossScaler` for fp16 (a ``torch.amp.GradScaler`` is converted with its
            settings and state); fp16 gets ``LossScaler()`` by default.
        kernels: kernel backend for the default scaler.
        fp32_modules: module classes whose forward runs in fp32 with autocast off.
        fp8: run the eligible ``nn.Linear`` layers' matmuls in fp8 through torchao (with
            ``"bf16-mixed"``): a recipe name or a :class:`~amp_plugin.fp8.Float8`; the layers are
            converted in ``fabric.setup(model)``, and :attr:`fp8_report` says which.

    ``fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})`` stores the
    scaler state (Fabric saves what it is handed, and it does not hand over the precision plugin
    by itself); ``fabric.load`` with the same keys restores it.

    Example:
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> plugin.precision, plugin.dtype, type(plugin.scaler).__name__
        ('16-mixed', torch.float16, 'LossScaler')
    """

    scaler: LossScaler | None  # type: ignore[assignment]  # MixedPrecision's is a GradScaler

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "auto"] = "auto",
        device: str | None = None,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
        kernels: Backend = "auto",
        fp32_modules: Sequence[type[nn.Module]] = (),
        guard: bool = True,
        fp8: Recipe | Float8 | None = None,
    ) -> None:
        checks.check_arguments(precision, scaler, "auto", "hold", guard)
        spec = check_fp8_request("AMPPrecision (Fabric)", fp8, precision)
        allowed = ("16-mixed", "bf16-mixed", "auto")
        hint = "the '-true' precisions are the Trainer plugin's: use Fabric(precision='bf16-true')."
        check_choice("AMPPrecision (Fabric)", "precision", precision, allowed, hint)
        self.kernels = check_backend(kernels, "AMPPrecision (Fabric)", "kernels")
        self.fp32_modules = fp32_policy.check_module_classes(fp32_modules, "AMPPrecision", "fp32_modules")
        fallback = "cuda" if torch.cuda.is_available() else "cpu"
        device_type, dtype, name = checks.resolve_settings(precision, fallback if device is None else device)
        if isinstance(scaler, torch.amp.GradScaler):
            scaler = LossScaler.from_grad_scaler(scaler)
        if scaler is None and dtype == torch.float16:
            scaler = LossScaler(kernels=self.kernels)
        # Fabric's own set-up (precision, device, scaler, the input dtype its ThroughputMonitor reads);
        # given a scaler, it builds no GradScaler.
        super().__init__(name, device_type, scaler=scaler)  # type: ignore[arg-type]
        self.requested, self.dtype = precision, dtype
        self.scaler = scaler
        if scaler is None and guard:  # bf16: nothing to scale, but every step is still checked
            scaler = LossScaler(init_scale=1.0, dynamic=False, kernels=self.kernels)
        self._driver = StepDriver(scaler)
        self._fp32_hooks: fp32_policy.Fp32Modules | None = None
        self.fp8 = spec
        self.fp8_report: Float8Report | None = None  # what convert_module ran in fp8

    @override
    def forward_context(self) -> torch.autocast:
        # cache_enabled=False, as in the Trainer plugin: ``fabric.autocast()`` may span a no_grad
        # forward and a later one with grad, and a cached weight cast would carry no history.
        return torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self._fp32_hooks is None and self.fp32_modules:
            self._fp32_hooks = fp32_policy.force_fp32(module, self.fp32_modules)
        if self.fp8 is not None:
            self.fp8_report = fp8_layers.convert(module, self.fp8)
            rank_zero_info(f"AMPPrecision (Fabric): {self.fp8_report}")
        return module

    @override
    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self._driver.backward_done()
        guard = self._driver.scaler  # scales for fp16; a non-finite loss makes the gradients NaN
        (tensor if guard is None else guard.scale(tensor)).backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless the loss or a gradient is inf/NaN (weights and optimizer state then stay as they were).

        Every precision is checked (see :attr:`guard`); the scale is updated after the step.
        """
        if self._driver.scaler is not None and checks.is_lbfgs(optimizer):
            raise TypeError(checks.LBFGS_REFUSAL)
        # fabric.clip_gradients (the only thing between backward and step) has unscaled already.
        return self._driver.step(optimizer, lambda: False, observe_unscaled=False, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients in place (and check them) before ``fabric.clip_gradients`` clips them.

        Also for fused optimizers (``fused=True``), which then step on the unscaled gradients;
        a second clip in the same step finds them unscaled already.
        """
        guard = self._driver.scaler
        if guard is not None and guard.stage(optimizer) == "ready":
            guard.unscale_(optimizer)

    @property
    def guard(self) -> LossScaler | None:
        """The :class:`LossScaler` that checks every step: the fp16 scaler, or a guard that scales nothing.

        ``None`` with ``guard=False``.

        Example:
            >>> AMPPrecision("bf16-mixed", device="cpu").guard.get_scale()
            1.0
        """
        return self._driver.scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``optimizer.step()`` was skipped for an inf/NaN loss or gradient.

        Example:
            >>> AMPPrecision("bf16-mixed", device="cpu").last_step_skipped
            False
        """
        return self._driver.last_step_skipped

    @override
    def teardown(self) -> None:
        if self._fp32_hooks is not None:
            self._fp32_hooks.remove()
            self._fp32_hooks = None
