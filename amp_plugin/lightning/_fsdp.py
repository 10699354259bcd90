"""``AMPFSDPPrecision``: Lightning's ``FSDPPrecision`` with a :class:`~amp_plugin.LossScaler`.

Lightning's ``FSDPStrategy`` (torch's ``FullyShardedDataParallel``, FSDP1) accepts only an
``FSDPPrecision`` and needs a CUDA accelerator. For ``"16-mixed"`` that plugin scales with
torch's ``ShardedGradScaler``, which all-reduces the inf flag in ``unscale_`` only: with a
fused optimizer (``AdamW(fused=True)``) Lightning skips ``unscale_``, the inf check runs
inside ``step`` without the all-reduce, and a rank whose shard overflowed skips while the
others step. This subclass carries a ``LossScaler`` instead, which agrees on the flag on
every path, and clips by the norm of all shards (``FSDPPrecision`` refuses norm clipping).
Every precision is guarded (a non-finite step is skipped on every rank, see :attr:`guard`).
Autocast, dtypes and the FSDP ``MixedPrecision`` config are Lightning's. Bad arguments raise
the errors ``FSDPPrecision`` raises, with its words and a ``HINT:`` added.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin._optim import handles_unscaling
from amp_plugin._run import assigned_scaler, guard_of, load_run_state, run_state
from amp_plugin._scaler import LossScaler
from amp_plugin._schedulers import hold_step_schedulers
from amp_plugin._step import StepDriver
from amp_plugin._validation import check_bool, check_choice, fail
from amp_plugin.fp8 import Float8Report
from amp_plugin.kernels import Backend, check_backend
from amp_plugin.lightning import _compat
from amp_plugin.lightning._checkpoint import grad_scaler_state
from amp_plugin.lightning._checks import backward_takes_gradient
from amp_plugin.spike import SpikeGuard, check_spike_guard

__all__ = ["AMPFSDPPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true")


class AMPFSDPPrecision(FSDPPrecision):
    """``FSDPPrecision`` whose ``"16-mixed"`` loss scaling is a :class:`~amp_plugin.LossScaler`.

    Args:
        precision: as for ``FSDPPrecision``; only ``"16-mixed"`` uses a scaler.
        scaler: the scaler for ``"16-mixed"`` (default: ``LossScaler("cuda")``, whose
            ``sync_found_inf="auto"`` agrees across all ranks). Must be ``None`` otherwise.
        guard: keyword-only, as for ``AMPPrecision`` (:class:`~amp_plugin.RunOptions`):
            check and skip every step in every precision.
        kernels: keyword-only: the kernel backend of the default scaler and the guard.
        spike_guard: keyword-only: a :class:`~amp_plugin.spike.SpikeGuard` that also skips
            loss spikes.
        lr_on_skip: keyword-only, as for ``AMPPrecision``: ``"hold"`` (the default) keeps a
            step-interval LR scheduler still when its optimizer's step was skipped; ``"advance"``
            steps it anyway. The other options of ``AMPPrecision`` (master weights, roundings,
            fp8, fp32 functions) are FSDP's own ``MixedPrecision`` config's business here.

    Example:
        >>> from amp_plugin import LossScaler
        >>> plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
        >>> type(plugin.scaler).__name__, plugin.precision
        ('LossScaler', '16-mixed')
        >>> AMPFSDPPrecision("bf16-mixed").scaler is None
        True
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        scaler: LossScaler | None = None,
        *,
        guard: bool = True,
        kernels: Backend = "auto",
        spike_guard: SpikeGuard | None = None,
        lr_on_skip: Literal["hold", "advance"] = "hold",
    ) -> None:
        if precision not in _PRECISIONS:
            fail(
                "AMPFSDPPrecision",
                passed=f"precision={precision!r}",
                why=(  # FSDPPrecision's words, which users and tests match on
                    f"`precision={precision!r}` is not supported in FSDP. `precision` must be one of: "
                    + ", ".join(map(repr, _PRECISIONS))
                ),
                allowed="one of those, as for Lightning's FSDPPrecision",
                hint="'16-mixed' is the precision that scales the loss.",
            )
        if scaler is not None and not isinstance(scaler, LossScaler):
            fail(
                "AMPFSDPPrecision",
                passed=f"scaler={type(scaler).__name__}",
                allowed="an amp_plugin.LossScaler or None",
                hint="pass LossScaler(...) (LossScaler.from_grad_scaler converts a torch scaler).",
                error=TypeError,
            )
        if scaler is not None and precision != "16-mixed":
            fail(
                "AMPFSDPPrecision",
                passed=f"precision={precision!r}, scaler=LossScaler",
                why=f"`precision={precision!r}` does not use a scaler",  # FSDPPrecision's words
                allowed="a scaler only with '16-mixed'",
                hint="drop the scaler: bf16 and fp32 need none.",
            )
        check_bool("AMPFSDPPrecision", "guard", guard)
        kernels = check_backend(kernels, "AMPFSDPPrecision", "kernels")
        spike_guard = check_spike_guard("AMPFSDPPrecision", spike_guard, guard)
        self.lr_on_skip: Literal["hold", "advance"] = check_choice(
            "AMPFSDPPrecision", "lr_on_skip", lr_on_skip, ("hold", "advance"), hint="use 'hold'."
        )
        if precision == "16-mixed" and scaler is None:
            scaler = LossScaler("cuda", kernels=kernels)
        _compat.init_fsdp_precision(self, precision, scaler)
        # Every step checked, on every rank.
        # Each rank holds its own shard of the gradients: norms are of every rank's shard together.
        checker = guard_of(scaler, guard, kernels, spike_guard)
        self._driver = StepDriver(checker, kernels=kernels, sharded=True)
        self.fp8_report: Float8Report | None = None  # FSDP's own config casts; no fp8 conversion here

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        hold_step_schedulers(lr_schedulers, self._driver, self.lr_on_skip)  # as AMPPrecision does
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def teardown(self) -> None:
        self._driver.settle()  # a held scheduler's check of the last fused step
        super().teardown()

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        _compat.before_backward_hooks(self, tensor, module)  # the hooks see the loss as computed
        return tensor  # backward scales it

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        # Scaled for fp16; a non-finite loss makes the gradients NaN. model.backward is what
        # Precision.backward calls.
        seedable = backward_takes_gradient(model)
        self._driver.backward(tensor, model.backward, *args, seedable=seedable, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self._driver.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None
            self._driver.not_stepped(optimizer, lambda: _compat.after_closure(self, model, optimizer))
            return None

        def hooks() -> None:  # the hooks, then clipping, as Lightning runs them
            _compat.after_closure(self, model, optimizer)

        # Fused optimizers unscale inside their step; the others before the hooks (and clipping) see them.
        unscale = not handles_unscaling(optimizer)
        return self._driver.step(
            optimizer, hooks, observe_unscaled=unscale, update=model.automatic_optimization, **kwargs
        )

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._driver.begin_batch()  # once per batch, before any clip
        with super().train_step_context():
            yield
        self._driver.end_batch()  # manual optimization: one update per batch, after every step

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (``FSDPPrecision``'s keys and ours), or the bf16/fp32 guard's as ``"guard"``.

        Lightning files it under this class's name and hands it back to :meth:`load_state_dict`.
        """
        return run_state(self._scaler, self._driver.scaler)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s result (or a ``GradScaler``'s); every part is checked first."""
        call = "AMPFSDPPrecision.load_state_dict"
        note = load_run_state(state_dict, self._scaler, self._driver.scaler, call=call)
        if note is not None:
            rank_zero_warn(note)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume the scale of a checkpoint written by Lightning's ``FSDPPrecision`` (``GradScaler``'s keys).

        Where the checkpoint has this class's own entry, Lightning loads that next instead.
        """
        theirs = checkpoint.get(FSDPPrecision.__qualname__)
        ours = type(self).__qualname__ in checkpoint
        if not ours and isinstance(theirs, dict) and self._scaler is not None:
            self.load_state_dict(theirs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also write the scale where Lightning's ``FSDPPrecision`` reads it, so going back keeps it.

        Lightning files this plugin's own state under its class name; ``FSDPPrecision`` looks under
        its own, in ``GradScaler``'s five keys.
        """
        scaler = self.scaler
        if scaler is not None and (state := grad_scaler_state(scaler.state_dict())):
            checkpoint[FSDPPrecision.__qualname__] = state

    @property  # type: ignore[override]  # FSDPPrecision has a ShardedGradScaler attribute here
    def scaler(self) -> LossScaler | None:
        """The ``"16-mixed"`` loss scaler, else ``None``; one assigned between steps is the one the steps use.

        Refused (``TypeError``/``ValueError``, nothing changed): anything but a ``LossScaler``, a
        scaler for another precision, ``None`` for ``"16-mixed"``.
        """
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | None) -> None:
        if "_driver" not in self.__dict__:  # FSDPPrecision's __init__ (run by _compat) assigning
            self._scaler = scaler
            return
        new = assigned_scaler("AMPFSDPPrecision", self.precision, None, scaler, grad_scaler=False)
        old, self._scaler = self._scaler, new
        if old is not None and self._driver.scaler is old:
            self._driver.scaler = new  # the steps read the driver's scaler

    @property
    def guard(self) -> LossScaler | None:
        """The :class:`LossScaler` that checks every step: the fp16 scaler, or a guard that scales nothing."""
        return self._driver.scaler

    @property
    def driver(self) -> StepDriver:
        """The :class:`~amp_plugin._step.StepDriver` of this plugin's steps (which were skipped)."""
        return self._driver

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped for an inf/NaN loss or gradient."""
        return self._driver.last_step_skipped

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The unscaled norm before clipping of every rank's gradient shard, this batch's latest, or ``None``.

        What a norm clip computed, or what :meth:`request_grad_norm` asked for.
        """
        return self._driver.last_grad_norm

    def request_grad_norm(self) -> None:
        """Have the next optimizer step record ``last_grad_norm`` (of every shard) even without clipping."""
        self._driver.request_grad_norm()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of every rank's gradient shard (one extra all-reduce of one element).

        Each rank's ``FullyShardedDataParallel`` gradients are its own disjoint shard
        (``FULL_SHARD``, ``SHARD_GRAD_OP``); under hybrid sharding or ``NO_SHARD`` the shards
        repeat across ranks and this norm would count them more than once.
        """
        guard = self._driver.scaler
        if guard is None:
            fail(
                "AMPFSDPPrecision.clip_grad_by_norm",
                passed="guard=False",
                why="the norm clip goes through the guard's LossScaler",
                allowed="the guard on (the norm clip goes through its LossScaler)",
                hint="use gradient_clip_algorithm='value', or drop guard=False.",
            )
        self._driver.clip_grad_norm_(optimizer, float(clip_val))  # sharded: the norm of every shard

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clamp the unscaled gradients (a fused optimizer's too: they are unscaled for the clamp first)."""
        self._driver.clip_grad_value_(optimizer, float(clip_val))
