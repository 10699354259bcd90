"""``SpikeGuard``: skip an optimizer step whose loss or gradient norm jumps far above its history.

Large runs skip the rare batch whose loss (or gradient norm) is many times its recent level,
because one such step can wreck an otherwise healthy run. The guard keeps, for each signal it
watches (``on``: the loss, the unscaled gradient norm, or both), the logs of its last ``window``
values of steps that were taken, on the device, and calls a step a spike when, after ``warmup``
recorded steps, a signal's log is both ``threshold`` standard deviations and ``log(min_ratio)``
above their mean. Everything runs on the device: the guard hands the
:class:`~amp_plugin.LossScaler` a 0-dim flag (``1.0``: spike) that is OR-ed into the step's skip
flag, so it adds no host read.

The scaler feeds it (:meth:`SpikeGuard.observe` from ``scale()``,
:meth:`SpikeGuard.observe_grad_norm` with the norm the step computed, :meth:`SpikeGuard.flag` at
the iteration's first ``step()``, :meth:`SpikeGuard.commit` from ``update()``) and checkpoints its
history with its own state (:meth:`SpikeGuard.state_dict`); a user only builds one and passes it on
(``LossScaler(spike_guard=...)``, ``AMPPrecision(spike_guard=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

import torch
from torch import Tensor

from amp_plugin._validation import check_int, check_number, fail

__all__ = ["SpikeGuard"]

Signal = Literal["loss", "grad_norm"]
_SIGNALS: tuple[Signal, ...] = ("loss", "grad_norm")


class SpikeGuard:
    """Flags a step whose loss or gradient norm is far above its running history (a log z-score).

    A step is a spike when, for one of the signals in ``on``, at least ``warmup`` values were
    recorded and ``log(x) - mean > max(threshold * std, log(min_ratio))``, with the mean and
    standard deviation of the logs of that signal's last ``window`` recorded values. Only the values
    of steps that were taken are recorded: a skipped step (a spike, or an inf/NaN) does not raise the
    bar for the next one. A value that is not a positive finite number is never a spike here
    (inf/NaN are the inf check's) and is not recorded.

    The signals:

    - ``"loss"``: the loss given to ``scale()``; with gradient accumulation the losses scaled before
      the iteration's first step are summed, so the guard sees the batch's loss.
    - ``"grad_norm"``: the total 2-norm of the unscaled gradients before any clipping, of the first
      optimizer stepped in the iteration. The step's own norm is taken where it computes one (a norm
      clip's, or the per-tensor norms of the inf check of the bf16/fp32 guard and of fused
      optimizers); only a loss-scaled step with a non-fused optimizer and no norm clip pays one
      read of the gradients for it.

    Under ``torch.distributed`` the scaler agrees the values across ranks (MAX, one collective per
    iteration) before the check, so every rank keeps the same history and makes the same decision.

    Args:
        threshold: standard deviations of the log above its mean (> 0).
        window: how many recorded values the mean and deviation are taken over (>= 2).
        warmup: recorded steps before the guard can fire (>= 2, at most ``window``).
        min_ratio: a spike is also at least this many times the history's geometric mean (>= 1),
            so that a run whose loss barely moves is not stopped by its own small noise.
        on: the signals watched, a tuple of ``"loss"`` and ``"grad_norm"`` (each its own history).

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
        self,
        threshold: float = 6.0,
        window: int = 100,
        warmup: int = 20,
        min_ratio: float = 2.0,
        *,
        on: Sequence[Signal] = ("loss",),
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
        self.on: tuple[Signal, ...] = _check_signals(on)
        self._log_min_ratio = math.log(self.min_ratio)
        self._history: Tensor | None = None  # per signal, the logs of its recorded values (ring buffers)
        self._count: Tensor | None = None  # per signal, recorded values so far (int64, on the device)
        self._spikes: Tensor | None = None  # spikes flagged so far (fp32, on the device)
        self._loaded: dict[str, Any] | None = None  # a loaded state, moved to the device on first use
        self._loss: Tensor | None = None  # this iteration's loss (summed), until flag()
        self._norm: Tensor | None = None  # this iteration's gradient norm, until flag()
        self._flag: Tensor | None = None  # this iteration's flag and logs, until commit()
        self._log: Tensor | None = None

    def observe(self, loss: Tensor) -> None:
        """Add ``loss`` (detached, summed to a scalar in fp32) to this iteration's loss."""
        if "loss" not in self.on:
            return
        value = loss.detach().float().sum()
        self._loss = value if self._loss is None else self._loss + value

    @property
    def wants_grad_norm(self) -> bool:
        """Whether this iteration still needs a gradient norm (watched, none observed, no flag made)."""
        return "grad_norm" in self.on and self._norm is None and self._flag is None

    @property
    def flag_made(self) -> bool:
        """Whether :meth:`flag` made this iteration's flag already (a later call returns that one)."""
        return self._flag is not None

    def observe_grad_norm(self, norm: Tensor) -> None:
        """Take ``norm`` (the unscaled total norm, 0-dim) as this iteration's gradient norm.

        Only the first norm of an iteration counts, and only before :meth:`flag`; later ones are ignored.
        """
        if self.wants_grad_norm:
            self._norm = norm.detach().float().reshape(())

    def flag(self, agree: Callable[[Tensor], Any] | None = None) -> Tensor | None:
        """This iteration's spike flag (0-dim fp32 on the values' device, ``1.0``: spike), made once.

        ``agree`` reduces the observed values (a 1-D fp32 tensor, one per signal) in place across
        ranks before the check. ``None`` when nothing was observed in this iteration. No host read.
        """
        if self._flag is not None:
            return self._flag
        values = self._values()
        if values is None:
            return None
        if agree is not None:
            agree(values)
        history, count, _ = self._buffers(values.device)
        log = torch.log(values)
        n = count.clamp(max=self.window)
        valid = torch.arange(self.window, device=values.device) < n.unsqueeze(1)
        nf = n.clamp(min=2).float()
        mean = torch.where(valid, history, 0.0).sum(1) / nf
        var = torch.where(valid, (history - mean.unsqueeze(1)) ** 2, 0.0).sum(1) / (nf - 1)
        bar = torch.clamp(var.sqrt() * self.threshold, min=self._log_min_ratio)
        # inf/NaN are the inf check's to skip; a non-positive value has no log: never a spike here.
        fired = (count >= self.warmup) & (log - mean > bar) & torch.isfinite(log)
        self._flag = fired.any().float()
        self._log = log
        return self._flag

    def commit(self, skipped: Tensor | bool) -> None:
        """Close the iteration: record its values unless its step was skipped (``skipped`` > 0).

        ``skipped`` is a host bool where the step read it already, else a device flag (no read).
        """
        flag, log = self._flag, self._log
        self.discard()
        if flag is None or log is None:
            return
        history, count, spikes = self._buffers(log.device)
        spikes.add_(flag)
        if skipped is True:
            return
        keep = torch.isfinite(log)
        if isinstance(skipped, Tensor):
            keep &= skipped.to(log.device) <= 0
        slot = torch.remainder(count, self.window).unsqueeze(1)
        old = history.gather(1, slot)
        history.scatter_(1, slot, torch.where(keep.unsqueeze(1), log.unsqueeze(1), old))
        count.add_(keep.long())

    def discard(self) -> None:
        """Drop this iteration's values and flag without recording anything (the step never ran)."""
        self._flag = self._log = self._loss = self._norm = None

    def recorded(self, signal: Signal | None = None) -> int:
        """How many values of ``signal`` (default: the first of ``on``) were recorded (one host read)."""
        if signal is not None and signal not in self.on:
            _refuse_signal("SpikeGuard.recorded", signal, self.on)
        index = 0 if signal is None else self.on.index(signal)
        if self._count is None:
            return 0 if self._loaded is None else int(self._loaded["recorded"][index])
        return int(self._count[index].item())

    def spikes(self) -> int:
        """How many iterations were flagged as spikes so far (one host read)."""
        if self._spikes is None:
            return 0 if self._loaded is None else int(self._loaded["spikes"])
        return int(self._spikes.item())

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history as plain Python values (host reads): what a resumed run needs to decide the same.

        ``on`` and ``window`` (what the history is of), ``history`` (per signal, the ``window`` logs
        of its ring buffer, fp32 values as floats), ``recorded`` (per signal) and ``spikes``.
        """
        if self._history is None or self._count is None or self._spikes is None:
            if self._loaded is not None:
                return dict(self._loaded)
            return {
                "on": list(self.on),
                "window": self.window,
                "history": [[0.0] * self.window for _ in self.on],
                "recorded": [0] * len(self.on),
                "spikes": 0,
            }
        return {
            "on": list(self.on),
            "window": self.window,
            "history": self._history.cpu().tolist(),
            "recorded": self._count.cpu().tolist(),
            "spikes": int(self._spikes.item()),
        }

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state_dict``; change nothing."""
        call = "SpikeGuard.load_state_dict"
        keys = {"on", "window", "history", "recorded", "spikes"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            fail(
                call,
                passed=f"state_dict={state_dict!r:.80}",
                why="it is not a spike guard's state",
                allowed=f"the dict from SpikeGuard.state_dict() (keys {sorted(keys)})",
                hint="pass the 'spike_guard' entry that LossScaler.state_dict() wrote.",
            )
        on, window = state_dict["on"], state_dict["window"]
        if tuple(on) != self.on or window != self.window:
            fail(
                call,
                passed=f"a history of on={tuple(on)}, window={window}",
                why=f"this guard watches on={self.on} over window={self.window}",
                allowed="the history of a guard with the same on= and window=",
                hint=f"resume with SpikeGuard(window={window}, on={tuple(on)}), or drop the "
                "'spike_guard' entry from the state to start its history afresh.",
            )
        rows, recorded = state_dict["history"], state_dict["recorded"]
        shape_ok = len(rows) == len(on) and all(len(r) == window for r in rows) and len(recorded) == len(on)
        if not shape_ok or any(not isinstance(n, int) or n < 0 for n in recorded):
            fail(
                call,
                passed=f"history of {len(rows)} rows, recorded={recorded!r:.40}",
                why="it does not hold one row of window values and one count per signal",
                allowed=f"{len(on)} rows of {window} floats and {len(on)} counts >= 0",
                hint="the state is corrupt: pass what SpikeGuard.state_dict() wrote.",
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s result (checked whole first); it moves to the device on first use.

        Refused in the middle of an iteration is the scaler's business; here any observed values are
        dropped, so the next iteration starts from the loaded history.
        """
        self.check_state_dict(state_dict)
        self._loaded = {
            "on": list(state_dict["on"]),
            "window": int(state_dict["window"]),
            "history": [[float(x) for x in row] for row in state_dict["history"]],
            "recorded": [int(n) for n in state_dict["recorded"]],
            "spikes": int(state_dict["spikes"]),
        }
        self._history = self._count = self._spikes = None
        self.discard()

    # -- internals --------------------------------------------------------------------------------

    def _values(self) -> Tensor | None:
        """The observed values, one per signal of ``on`` (NaN where one is missing); clears them."""
        observed = {"loss": self._loss, "grad_norm": self._norm}
        present = [v for v in observed.values() if v is not None]
        if not present:
            return None
        device = present[0].device
        missing = torch.full((), math.nan, device=device) if len(present) < len(self.on) else None
        self._loss = self._norm = None
        return torch.stack([_or_missing(observed[s], device, missing) for s in self.on])

    def _buffers(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The histories, the recorded counts and the spike count, made on ``device`` on first use."""
        if self._history is None or self._count is None or self._spikes is None:
            loaded = self._loaded
            self._loaded = None
            if loaded is None:
                self._history = torch.zeros(len(self.on), self.window, dtype=torch.float32, device=device)
                self._count = torch.zeros(len(self.on), dtype=torch.int64, device=device)
                self._spikes = torch.zeros((), dtype=torch.float32, device=device)
            else:  # one host-to-device copy after a resume, not one per step
                self._history = torch.tensor(loaded["history"], dtype=torch.float32).to(device)
                self._count = torch.tensor(loaded["recorded"], dtype=torch.int64).to(device)
                self._spikes = torch.tensor(float(loaded["spikes"]), dtype=torch.float32).to(device)
        return self._history, self._count, self._spikes


def _or_missing(value: Tensor | None, device: torch.device, missing: Tensor | None) -> Tensor:
    """``value`` on ``device``, or ``missing`` (a NaN: never a spike, never recorded) for ``None``."""
    if value is None:
        assert missing is not None  # made whenever a signal is missing
        return missing
    return value.to(device)


def _check_signals(on: object) -> tuple[Signal, ...]:
    """``on`` as a tuple of distinct known signals; raise (what, allowed, ``HINT:``) else."""
    call = "SpikeGuard"
    allowed = 'a non-empty tuple of "loss" and "grad_norm", each at most once'
    if isinstance(on, str) or not isinstance(on, (tuple, list)):
        fail(
            call,
            passed=f"on={on!r}",
            why="it is not a tuple of signal names",
            allowed=allowed,
            hint=f"pass on=({on!r},)." if isinstance(on, str) else 'pass on=("loss", "grad_norm").',
            error=TypeError,
        )
    if not on:
        fail(call, passed="on=()", why="it watches nothing", allowed=allowed, hint='pass on=("loss",).')
    for signal in on:
        if signal not in _SIGNALS:
            _refuse_signal(call, signal, _SIGNALS, f"on={tuple(on)!r}")
    if len(set(on)) != len(on):
        fail(
            call,
            passed=f"on={tuple(on)!r}",
            why="a signal is named twice",
            allowed=allowed,
            hint="name each signal once.",
        )
    return tuple(on)


def _refuse_signal(call: str, signal: object, allowed: Sequence[str], passed: str = "") -> NoReturn:
    fail(
        call,
        passed=passed or f"signal={signal!r}",
        why=f"{signal!r} is not a signal here",
        allowed=" or ".join(map(repr, allowed)),
        hint='the signals are "loss" and "grad_norm" (SpikeGuard(on=...) names those watched).',
    )


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
