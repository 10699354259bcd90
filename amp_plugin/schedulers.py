"""``SkipAwareScheduler``: a step-interval LR scheduler that holds still when the optimizer step was skipped.

The Trainer's ``AMPPrecision`` wraps every step-interval scheduler in one at fit start; Fabric's
``AMPPrecision`` wraps the one handed to its ``skip_aware``. The wrapper asks the plugin's step
driver (:class:`~amp_plugin.step.StepDriver`) whether the step it follows was skipped. Plain torch:
nothing here imports Lightning.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

from amp_plugin._validation import fail

__all__ = ["SkipAwareScheduler"]

_SCHEDULER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class _StepSkips(Protocol):
    """What the wrapper reads of the steps (a :class:`~amp_plugin.step.StepDriver` is one)."""

    @property
    def last_step_skipped(self) -> bool: ...

    def known_skip(self, optimizer: Any) -> bool | None: ...

    def step_skipped(self, optimizer: Any) -> bool: ...


class SkipAwareScheduler:
    """A step-interval LR scheduler that holds still when the optimizer step was skipped.

    Everything but ``step`` goes to the wrapped scheduler, so checkpoints, ``get_last_lr``
    and Lightning's LearningRateMonitor see the original object's state. With the plugin's
    ``lr_on_skip="advance"`` a skipped step still steps the scheduler, without PyTorch's
    "``lr_scheduler.step()`` before ``optimizer.step()``" warning (the skip is why).

    Args:
        scheduler: the LR scheduler to wrap.
        steps: says whether a step was skipped (``known_skip(optimizer)`` where that needs no
            host read, else ``step_skipped(optimizer)``; ``last_step_skipped`` for a scheduler
            without ``.optimizer``): the plugin's :class:`~amp_plugin.step.StepDriver`.
        lr_on_skip: ``"hold"`` keeps the scheduler still after a skipped step; ``"advance"`` steps it.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> class Taken:  # what the step driver says after a step that was taken
        ...     last_step_skipped = False
        ...     def known_skip(self, optimizer): return False
        ...     def step_skipped(self, optimizer): return False
        >>> scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), Taken())
        >>> opt.step(); scheduler.step()  # a step that was taken: the scheduler moves
        >>> scheduler.get_last_lr()
        [0.5]
        >>> class Skipped:  # what the step driver says after an overflow
        ...     last_step_skipped = True
        ...     def known_skip(self, optimizer): return True
        ...     def step_skipped(self, optimizer): return True
        >>> held = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), Skipped())
        >>> held.step(); held.get_last_lr()
        [0.5]
    """

    def __init__(self, scheduler: Any, steps: _StepSkips, lr_on_skip: str = "hold") -> None:
        if lr_on_skip not in ("hold", "advance"):
            fail(
                "SkipAwareScheduler",
                passed=f"lr_on_skip={lr_on_skip!r}",
                why="there is no such mode",
                allowed="'hold' or 'advance'",
                hint="'hold' keeps the schedule in step with the weights' updates.",
            )
        if isinstance(scheduler, torch.optim.Optimizer) or not callable(getattr(scheduler, "step", None)):
            kind = "an optimizer" if isinstance(scheduler, torch.optim.Optimizer) else "no step()"
            fail(
                "SkipAwareScheduler",
                passed=f"scheduler={type(scheduler).__name__ if scheduler is not None else None} ({kind})",
                allowed="an LR scheduler (anything with step(), torch.optim.lr_scheduler's or your own)",
                hint="pass the LR scheduler built on the optimizer, e.g. skip_aware(StepLR(optimizer, 10)).",
                error=TypeError,
            )
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_steps"] = steps
        self.__dict__["_lr_on_skip"] = lr_on_skip

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless its optimizer's step was skipped and the plugin holds.

        The hold is on the skipped step itself. Where the step read its skip flag already
        (non-fused optimizers) this costs nothing; a fused optimizer skips on the device, and
        holding then costs one host read of its flag per step (shared with every later reader of
        it). ``lr_on_skip="advance"`` never reads.
        """
        optimizer = getattr(self._scheduler, "optimizer", None)
        steps = self._steps
        known = steps.known_skip(optimizer) if optimizer is not None else steps.last_step_skipped
        if self._lr_on_skip == "advance":
            self._advance(bool(known), *args, **kwargs)  # a fused step called optimizer.step(): no warning
            return
        if known is None:  # a fused step: its flag is read here, on the step it describes
            known = steps.step_skipped(optimizer)
        if not known:
            self._scheduler.step(*args, **kwargs)

    def _advance(self, skipped: bool, *args: Any, **kwargs: Any) -> None:
        if not skipped:
            self._scheduler.step(*args, **kwargs)
            return
        with warnings.catch_warnings():  # the skip is why optimizer.step() never ran
            warnings.filterwarnings("ignore", message=_SCHEDULER_WARNING)
            self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # copy and pickle probe a bare instance (no _scheduler yet) for __setstate__ and the like.
        if name.startswith("__") or "_scheduler" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)
