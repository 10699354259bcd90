"""What both ``AMPPrecision`` classes (Trainer, Fabric) show of their :class:`~amp_plugin._run.AMPRun`.

Written once: each attribute reads the plugin's run, so the two plugins cannot drift apart. Only
``scaler`` can be assigned (between steps); the settings are fixed when the plugin is built.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_plugin._run import AMPRun
from amp_plugin._scaler import LossScaler

__all__ = ["RunView"]


def _read(name: str, doc: str) -> Any:
    def get(plugin: RunView) -> Any:
        return getattr(plugin._run, name)

    return property(get, doc=doc)


class RunView:
    """The settings and the state of the plugin's run, read from ``_run``."""

    _run: AMPRun

    requested = _read("requested", "The precision as it was passed (``'auto'`` stays ``'auto'``).")
    precision = _read("precision", "The precision string; ``'auto'`` until it is resolved on a device.")
    device = _read("device", "The autocast device type (``None`` until resolved).")
    dtype = _read("dtype", "The autocast (or weight) dtype; ``None`` until resolved.")
    kernels = _read("kernels", "The kernel backend of the default scaler, the guard and clipping.")
    fp32_modules = _read("fp32_modules", "Module classes whose forward runs in fp32 with autocast off.")
    fp32_functions = _read("fp32_functions", "Functions whose calls in forward passes run in fp32.")
    clip_fused = _read(
        "clip_fused", "Whether clipping takes the fast path: ``'auto'``, ``True`` or ``False``."
    )
    lr_on_skip = _read("lr_on_skip", "What a step-interval scheduler does on a skipped step.")
    master_weights = _read("master_weights", "``True``/``'remainder'``: fp32 master weights; else ``False``.")
    rounding = _read("rounding", "How updates are written into '-true' weights.")
    fp8 = _read("fp8", "The fp8 request (a :class:`~amp_plugin.fp8.Float8`), or ``None``.")
    fp8_report = _read(
        "fp8_report", "Which layers the model's conversion ran in fp8 (``None`` before, or without fp8)."
    )
    spike_guard = _read("spike_guard", "The :class:`~amp_plugin.spike.SpikeGuard`, or ``None``.")
    fp32_grad_accumulation = _read(
        "fp32_grad_accumulation", "Whether micro-batch gradients may add up in fp32."
    )
    masters = _read(
        "masters", "The fp32 master weights (``master_weights``, once the model is converted), else ``None``."
    )
    driver = _read(
        "driver",
        "The :class:`~amp_plugin._step.StepDriver` of this plugin's steps (which were skipped, per optimizer "
        "and per batch); ``None`` until the precision is resolved.",
    )

    @property
    def scaler(self) -> LossScaler | None:
        """The fp16 loss scaler (``None`` for the other precisions, and for ``"auto"`` until resolved).

        Assigning one between steps (``precision.scaler = LossScaler(...)``) makes the steps use it:
        it is also the :attr:`guard`. A ``torch.amp.GradScaler`` is converted, as in the constructor.
        Refused (``TypeError``/``ValueError``, nothing changed): anything else, a scaler for a
        precision without loss scaling, ``None`` for fp16.

        Example:
            >>> from amp_plugin import AMPPrecision, LossScaler
            >>> plugin = AMPPrecision("16-mixed", device="cpu")
            >>> plugin.scaler = LossScaler("cpu", init_scale=8.0)
            >>> plugin.guard is plugin.scaler, plugin.scaler.get_scale()
            (True, 8.0)
        """
        return self._run.scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | torch.amp.GradScaler | None) -> None:
        if "_run" not in self.__dict__:  # a base class's __init__ assigning before ours built the run
            return
        self._run.scaler = scaler

    @property
    def guard(self) -> LossScaler | None:
        """The :class:`~amp_plugin.LossScaler` that checks every step and skips non-finite ones.

        The fp16 loss scaler itself (:attr:`scaler`), or for bf16, fp32 and the "-true" precisions
        a guard that scales nothing (a static scale of 1) and checks the gradients read-only.
        ``None`` with ``guard=False``, or until the precision is resolved.

        Example:
            >>> from amp_plugin.lightning.fabric import AMPPrecision
            >>> AMPPrecision("bf16-mixed", device="cpu").guard.get_scale()
            1.0
        """
        return self._run.guard

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped for an inf/NaN (or spiking) loss or gradient.

        ``False`` before the first. Right after ``opt.step()`` in manual optimization it describes
        that step; after the batch's scale update, whether any step of the batch was skipped.
        """
        return self._run.last_step_skipped
