"""``SpikeGuard``: skip an optimizer step whose loss jumps far above its recent history.

Large runs skip the rare batch whose loss is many times its recent level, because one such step
can wreck an otherwise healthy run. The guard keeps the log of the last ``window`` losses of
steps that were taken, on the loss's device, and calls a loss a spike when, after ``warmup``
recorded steps, its log is both ``threshold`` standard deviations and ``log(min_ratio)`` above
their mean. Everything runs on the device: the guard hands the :class:`~amp_plugin.LossScaler`
a 0-dim flag (``1.0``: spike) that is OR-ed into the step's skip flag, so it adds no host read.

The scaler feeds it (:meth:`SpikeGuard.observe` from ``scale()``, :meth:`SpikeGuard.flag` at the
iteration's first ``step()``, :meth:`SpikeGuard.commit` from ``update()``); a user only builds one
and passes it on (``LossScaler(spike_guard=...)``, ``AMPPrecision(spike_guard=...)``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from amp_plugin._validation import check_int, check_number, fail

__all__ = ["SpikeGuard", "check_spike_guard"]


class SpikeGuard:
    """Flags losses far above their running history (a z-score of the log-loss over a window).

    A loss ``x`` is a spike when at least ``warmup`` steps were recorded and
    ``log(x) - mean > max(threshold * std, log(min_ratio))``, with the mean and standard deviation
    of the logs of the last ``window`` recorded losses. Only the losses of steps that were taken
    are recorded: a skipped step (a spike, or an inf/NaN) does not raise the bar for the next one.
    A loss that is not a positive finite number is never a spike here (inf/NaN are the inf check's)
    and is not recorded. With gradient accumulation the losses scaled before the iteration's first
    step are summed, so the guard sees the batch's loss.

    Args:
        threshold: standard deviations of the log-loss above its mean (> 0).
        window: how many recorded losses the mean and deviation are taken over (>= 2).
        warmup: recorded steps before the guard can fire (>= 2, at most ``window``).
        min_ratio: a spike is also at least this many times the history's geometric mean (>= 1),
            so that a run whose loss barely moves is not stopped by its own small noise.

    Example:
        >>> guard = SpikeGuard(warmup=3, window=8)
        >>> fired = []
        >>> for loss in (1.0, 1.1, 0.9, 1.0, 1000.0, 1.05):
        ...     guard.observe(torch.tensor(loss))
        ...     flag = guard.flag()
        ...     fired.append(int(flag.item()))
        ...     guard.commit(flag)
        >>> fired, guard.recorded(), guard.spikes()
        ([0, 0, 0, 0, 1, 0], 5, 1)
    """

    def __init__(
        self, threshold: float = 6.0, window: int = 100, warmup: int = 20, min_ratio: float = 2.0
    ) -> None:
        call = "SpikeGuard"
        self.threshold = check_number(
            call, "threshold", threshold, low=0.0, low_open=True, hint="6.0 is the default."
        )
        self.window = check_int(call, "window", window, low=2, hint="100 is the default.")
        self.warmup = check_int(call, "warmup", warmup, low=2, hint="20 is the default.")
        if self.warmup > self.window:
            fail(
                call,
                passed=f"warmup={warmup}, window={window}",
                why="the warm-up fills the window, so it cannot be longer than the window",
                allowed="warmup <= window",
                hint=f"pass warmup={self.window} or a larger window.",
            )
        self.min_ratio = check_number(call, "min_ratio", min_ratio, low=1.0, hint="2.0 is the default.")
        self._log_min_ratio = math.log(self.min_ratio)
        self._history: Tensor | None = None  # the logs of the recorded losses (a ring buffer)
        self._count: Tensor | None = None  # recorded losses so far (int64, on the device)
        self._spikes: Tensor | None = None  # spikes flagged so far (fp32, on the device)
        self._loss: Tensor | None = None  # this iteration's loss (summed), until flag()
        self._flag: Tensor | None = None  # this iteration's flag and log-loss, until commit()
        self._log: Tensor | None = None

    def observe(self, loss: Tensor) -> None:
        """Add ``loss`` (detached, summed to a scalar in fp32) to this iteration's loss."""
        value = loss.detach().float().sum()
        self._loss = value if self._loss is None else self._loss + value

    def flag(self) -> Tensor | None:
        """This iteration's spike flag (0-dim fp32 on the loss's device, ``1.0``: spike), made once.

        ``None`` when no loss was observed in this iteration. No host read.
        """
        if self._flag is not None or self._loss is None:
            return self._flag
        loss, self._loss = self._loss, None
        history, count, _ = self._buffers(loss.device)
        log = torch.log(loss)
        n = count.clamp(max=self.window)
        valid = torch.arange(self.window, device=loss.device) < n
        nf = n.clamp(min=2).float()
        mean = torch.where(valid, history, 0.0).sum() / nf
        var = torch.where(valid, (history - mean) ** 2, 0.0).sum() / (nf - 1)
        bar = torch.clamp(var.sqrt() * self.threshold, min=self._log_min_ratio)
        # inf/NaN are the inf check's to skip; a non-positive loss has no log: never a spike here.
        self._flag = ((count >= self.warmup) & (log - mean > bar) & torch.isfinite(log)).float()
        self._log = log
        return self._flag

    def commit(self, skipped: Tensor | bool) -> None:
        """Close the iteration: record its loss unless its step was skipped (``skipped`` > 0).

        ``skipped`` is a host bool where the step read it already, else a device flag (no read).
        """
        flag, log = self._flag, self._log
        self._flag = self._log = self._loss = None
        if flag is None or log is None:
            return
        history, count, spikes = self._buffers(log.device)
        spikes.add_(flag)
        if skipped is True:
            return
        keep = torch.isfinite(log)
        if isinstance(skipped, Tensor):
            keep &= skipped.to(log.device) <= 0
        slot = torch.remainder(count, self.window).reshape(1)
        old = history.index_select(0, slot)
        history.index_copy_(0, slot, torch.where(keep, log.reshape(1), old))
        count.add_(keep.long())

    def discard(self) -> None:
        """Drop this iteration's loss and flag without recording anything (the step never ran)."""
        self._flag = self._log = self._loss = None

    def recorded(self) -> int:
        """How many losses were recorded so far (one host read)."""
        return 0 if self._count is None else int(self._count.item())

    def spikes(self) -> int:
        """How many iterations were flagged as spikes so far (one host read)."""
        return 0 if self._spikes is None else int(self._spikes.item())

    def _buffers(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The history, the recorded count and the spike count, made on ``device`` on first use."""
        if self._history is None or self._count is None or self._spikes is None:
            self._history = torch.zeros(self.window, dtype=torch.float32, device=device)
            self._count = torch.zeros((), dtype=torch.int64, device=device)
            self._spikes = torch.zeros((), dtype=torch.float32, device=device)
        return self._history, self._count, self._spikes


def check_spike_guard(call: str, spike_guard: object, guard: bool = True) -> SpikeGuard | None:
    """``spike_guard`` if it is a :class:`SpikeGuard` or ``None``; raise (what, allowed, ``HINT:``) else.

    ``guard=False`` (no step is checked) cannot carry one: the spike flag rides on the guard's skip.

    Example:
        >>> check_spike_guard("AMPPrecision", None) is None
        True
        >>> check_spike_guard("AMPPrecision", SpikeGuard(), guard=False)
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(guard=False, spike_guard=SpikeGuard) is not allowed... HINT: ...
    """
    if spike_guard is None:
        return None
    if not isinstance(spike_guard, SpikeGuard):
        fail(
            call,
            passed=f"spike_guard={type(spike_guard).__qualname__}",
            allowed="a SpikeGuard or None",
            hint="pass amp_plugin.spike.SpikeGuard() (its defaults suit most runs).",
            error=TypeError,
        )
    if not guard:
        fail(
            call,
            passed="guard=False, spike_guard=SpikeGuard",
            why="the spike guard skips through the guard's flag, and guard=False turns that off",
            allowed="a spike guard only where the steps are guarded",
            hint="drop guard=False, or drop spike_guard=.",
        )
    return spike_guard
