"""``SkipAwareScheduler``: a step-interval LR scheduler that holds still when the optimizer step was skipped.

``AMPPrecision`` wraps every step-interval scheduler in one at fit start; the wrapper asks the
plugin whether the step it follows was skipped.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

__all__ = ["SkipAwareScheduler"]

_SCHEDULER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class _StepSkips(Protocol):
    """What the wrapper reads of its plugin (``AMPPrecision`` is one)."""

    @property
    def lr_on_skip(self) -> str: ...

    @property
    def last_step_skipped(self) -> bool: ...

    def step_skipped(self, optimizer: Any) -> bool: ...


class SkipAwareScheduler:
    """A step-interval LR scheduler that holds still when the optimizer step was skipped.

    Everything but ``step`` goes to the wrapped scheduler, so checkpoints, ``get_last_lr``
    and Lightning's LearningRateMonitor see the original object's state. With the plugin's
    ``lr_on_skip="advance"`` a skipped step still steps the scheduler, without PyTorch's
    "``lr_scheduler.step()`` before ``optimizer.step()``" warning (the skip is why).

    Args:
        scheduler: the LR scheduler to wrap.
        plugin: says whether a step was skipped (``step_skipped(optimizer)``, or
            ``last_step_skipped`` for a scheduler without ``.optimizer``) and what to do then
            (``lr_on_skip``: ``"hold"`` or ``"advance"``); an ``AMPPrecision``.

    Example:
        >>> import torch
        >>> from amp_plugin.lightning import AMPPrecision
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> plugin = AMPPrecision("16-mixed", device="cpu")
        >>> scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), plugin)
        >>> opt.step(); scheduler.step()  # a step that was taken: the scheduler moves
        >>> scheduler.get_last_lr()
        [0.5]
        >>> class Skipped:  # what AMPPrecision says after an overflow
        ...     lr_on_skip, last_step_skipped = "hold", True
        ...     def step_skipped(self, optimizer): return True
        >>> held = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), Skipped())
        >>> held.step(); held.get_last_lr()
        [0.5]
    """

    def __init__(self, scheduler: Any, plugin: _StepSkips) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_plugin"] = plugin

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless its optimizer's step was skipped and the plugin holds."""
        optimizer = getattr(self._scheduler, "optimizer", None)
        plugin = self._plugin
        if not (plugin.last_step_skipped if optimizer is None else plugin.step_skipped(optimizer)):
            self._scheduler.step(*args, **kwargs)
            return
        if plugin.lr_on_skip == "hold":
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
