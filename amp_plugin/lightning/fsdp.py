"""``AMPFSDPPrecision``: Lightning's ``FSDPPrecision`` with a :class:`~amp_plugin.LossScaler`.

Lightning's ``FSDPStrategy`` (torch's ``FullyShardedDataParallel``, FSDP1) accepts only an
``FSDPPrecision`` and needs a CUDA accelerator. For ``"16-mixed"`` that plugin scales with
torch's ``ShardedGradScaler``, which all-reduces the inf flag in ``unscale_`` only: with a
fused optimizer (``AdamW(fused=True)``) Lightning skips ``unscale_``, the inf check runs
inside ``step`` without the all-reduce, and a rank whose shard overflowed skips while the
others step. This subclass carries a ``LossScaler`` instead, which agrees on the flag on
every path, and clips by the norm of all shards (``FSDPPrecision`` refuses norm clipping).
Every other behaviour (autocast, dtypes, the FSDP ``MixedPrecision`` config) is Lightning's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin._validation import fail
from amp_plugin.optim import handles_unscaling, unwrap_optimizer
from amp_plugin.scaler import LossScaler

__all__ = ["AMPFSDPPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true")


class AMPFSDPPrecision(FSDPPrecision):
    """``FSDPPrecision`` whose ``"16-mixed"`` loss scaling is a :class:`~amp_plugin.LossScaler`.

    Args:
        precision: as for ``FSDPPrecision``; only ``"16-mixed"`` uses a scaler.
        scaler: the scaler for ``"16-mixed"`` (default: ``LossScaler("cuda")``, whose
            ``sync_found_inf="auto"`` agrees across all ranks). Must be ``None`` otherwise.

    Example:
        >>> from amp_plugin import LossScaler
        >>> plugin = AMPFSDPPrecision("16-mixed", scaler=LossScaler("cpu"))
        >>> type(plugin.scaler).__name__, plugin.precision
        ('LossScaler', '16-mixed')
        >>> AMPFSDPPrecision("bf16-mixed").scaler is None
        True
    """

    scaler: Any  # a LossScaler for "16-mixed", else None (the base class annotates ShardedGradScaler)

    def __init__(self, precision: str = "16-mixed", scaler: LossScaler | None = None) -> None:
        if precision not in _PRECISIONS:
            fail("AMPFSDPPrecision", f"precision={precision!r}", ", ".join(map(repr, _PRECISIONS)),
                 "'16-mixed' is the precision that scales the loss.")  # fmt: skip
        if scaler is not None and not isinstance(scaler, LossScaler):
            fail("AMPFSDPPrecision", f"scaler={type(scaler).__name__}", "an amp_plugin.LossScaler or None",
                 "pass LossScaler(...) (LossScaler.from_grad_scaler converts a torch scaler).",
                 TypeError)  # fmt: skip
        if scaler is not None and precision != "16-mixed":
            fail("AMPFSDPPrecision", f"precision={precision!r}, scaler=LossScaler",
                 "a scaler only with precision='16-mixed'",
                 "drop the scaler: bf16 and fp32 need none.")  # fmt: skip
        if precision == "16-mixed" and scaler is None:
            scaler = LossScaler("cuda")
        # Lightning 2.6's FSDPPrecision checks ``self.precision`` (still the class default) before it
        # sets it, so it refuses any scaler, and it then stores None instead of the scaler passed.
        # Set the precision first (the check passes, no ShardedGradScaler is built), the scaler after.
        self.precision = precision  # type: ignore[assignment]
        super().__init__(precision, scaler=scaler)  # type: ignore[arg-type]
        self.scaler = scaler

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None
            self._after_closure(model, optimizer)
            scaler._forget(optimizer)
            return None
        if not handles_unscaling(unwrap_optimizer(optimizer)):
            scaler.unscale_(optimizer)  # hooks and clipping see unscaled gradients
        self._after_closure(model, optimizer)
        scaler.recheck_(optimizer)  # a hook may have written inf/NaN after unscale_
        result = scaler.step(optimizer, **kwargs)  # the inf flag is all-reduced first, fused or not
        scaler.update()
        return result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of every rank's gradient shard (one extra all-reduce of one element).

        Each rank's ``FullyShardedDataParallel`` gradients are its own disjoint shard
        (``FULL_SHARD``, ``SHARD_GRAD_OP``); under hybrid sharding or ``NO_SHARD`` the shards
        repeat across ranks and this norm would count them more than once.
        """
        if self.scaler is None:
            fail("AMPFSDPPrecision.clip_grad_by_norm", f"precision={self.precision!r}",
                 "precision='16-mixed' (the norm clip goes through the LossScaler)",
                 "use gradient_clip_algorithm='value', or precision='16-mixed'.")  # fmt: skip
        self.scaler.clip_grad_norm_(optimizer, float(clip_val), sharded=True)
