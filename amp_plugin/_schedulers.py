"""``SkipAwareScheduler``: a step-interval LR scheduler that holds still when the optimizer step was skipped.

The Trainer's ``AMPPrecision`` wraps every step-interval scheduler in one at fit start; Fabric's
``AMPPrecision`` wraps the one handed to its ``skip_aware``. The wrapper asks the plugin's step
driver (:class:`~amp_plugin._step.StepDriver`) whether the step it follows was skipped. Plain torch:
nothing here imports Lightning.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from amp_plugin._validation import fail

__all__ = ["SkipAwareScheduler", "hold_step_schedulers"]

_SCHEDULER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class _StepSkips(Protocol):
    """What the wrapper reads of the steps (a :class:`~amp_plugin._step.StepDriver` is one)."""

    @property
    def last_step_skipped(self) -> bool: ...

    def known_skip(self, optimizer: Any) -> bool | None: ...

    def step_skipped(self, optimizer: Any) -> bool: ...

    def deferred_skip(self, optimizer: Any) -> bool | Callable[[], bool]: ...

    def before_next_step(self, callback: Callable[[], None]) -> None: ...


class _Undo:
    """What a scheduler's step changes, as it was before: the scheduler's state and its optimizer's groups.

    Built before the step; :meth:`advanced` records the groups' values after it, so that
    :meth:`apply` takes back only what the scheduler changed and keeps what was set since (an LR
    written by hand between the two steps stays).
    """

    def __init__(self, scheduler: Any, optimizer: Any) -> None:
        self.state = copy.deepcopy(scheduler.state_dict())
        self.before = [_values(group) for group in optimizer.param_groups]
        self.after: list[dict[str, Any]] = []

    def advanced(self, optimizer: Any) -> None:
        self.after = [_values(group) for group in optimizer.param_groups]

    def apply(self, scheduler: Any, optimizer: Any) -> None:
        scheduler.load_state_dict(self.state)
        for group, before, after in zip(optimizer.param_groups, self.before, self.after, strict=True):
            for key, value in before.items():
                now = group.get(key)
                if isinstance(value, Tensor) and isinstance(now, Tensor):
                    now.copy_(value)  # a tensor lr (fused, capturable) keeps its identity
                elif now is after.get(key) or now == after.get(key):
                    group[key] = value  # the scheduler's change, not one made since


def _values(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (not its params), copied: tensors cloned, the rest deep-copied."""
    return {
        k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in group.items() if k != "params"
    }


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
            without ``.optimizer``): the plugin's :class:`~amp_plugin._step.StepDriver`.
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
                "AMPPrecision.skip_aware",
                passed=f"lr_on_skip={lr_on_skip!r}",
                why="there is no such mode",
                allowed="'hold' or 'advance'",
                hint="'hold' keeps the schedule in step with the weights' updates.",
            )
        if isinstance(scheduler, torch.optim.Optimizer) or not callable(getattr(scheduler, "step", None)):
            kind = "an optimizer" if isinstance(scheduler, torch.optim.Optimizer) else "no step()"
            fail(
                "AMPPrecision.skip_aware",
                passed=f"scheduler={type(scheduler).__name__ if scheduler is not None else None} ({kind})",
                allowed="an LR scheduler (anything with step(), torch.optim.lr_scheduler's or your own)",
                hint="pass the LR scheduler built on the optimizer, e.g. skip_aware(StepLR(optimizer, 10)).",
                error=TypeError,
            )
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_steps"] = steps
        self.__dict__["_lr_on_skip"] = lr_on_skip
        self.__dict__["_pending"] = None  # (whether the step was skipped, the undo of the advance)
        optimizer = getattr(scheduler, "optimizer", None)
        if lr_on_skip == "hold" and isinstance(optimizer, torch.optim.Optimizer):
            # A checkpoint saves the optimizer before the scheduler: its groups must be settled too.
            optimizer.register_state_dict_pre_hook(_settles(weakref.ref(self)))

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless its optimizer's step was skipped and the plugin holds.

        The hold is on the skipped step itself: the next optimizer step runs with the LR the
        skipped one had. Where the step read its skip flag already (non-fused optimizers, and
        any optimizer on a CPU) this costs nothing. A fused optimizer on an accelerator skips on
        the device: its flag is copied to the host behind the step, without waiting, and the
        scheduler advances at once; the next optimizer step (or anything that reads the scheduler
        or saves the optimizer first) reads that copy, by then done, and takes the advance back if
        the step was skipped. Until then the optimizer's ``param_groups`` show the advanced LR.
        ``lr_on_skip="advance"`` never reads.
        """
        optimizer = getattr(self._scheduler, "optimizer", None)
        steps = self._steps
        known = steps.known_skip(optimizer) if optimizer is not None else steps.last_step_skipped
        if self._lr_on_skip == "advance":
            self._advance(bool(known), *args, **kwargs)  # a fused step called optimizer.step(): no warning
            return
        if known is None:  # a fused step's device flag
            known = steps.deferred_skip(optimizer)
        if callable(known):  # not known without waiting: advance now, take it back if it was skipped
            self._advance_until_known(known, optimizer, *args, **kwargs)
        elif not known:
            self._scheduler.step(*args, **kwargs)

    def settle(self) -> None:
        """Take back the last advance if its step turns out skipped (waits for that step's flag alone).

        Runs at the start of the next optimizer step, and before anything else reads the scheduler
        (its state dict, ``get_last_lr``, any attribute) or the optimizer's state dict.
        """
        pending = self.__dict__["_pending"]
        if pending is None:
            return
        self.__dict__["_pending"] = None
        skipped, undo = pending
        if skipped():
            undo.apply(self._scheduler, self._scheduler.optimizer)

    def _advance_until_known(
        self, skipped: Callable[[], bool], optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        self.settle()  # stepped twice with no optimizer step between: the first is settled at once
        undo = _Undo(self._scheduler, optimizer)
        self._scheduler.step(*args, **kwargs)
        undo.advanced(optimizer)
        self.__dict__["_pending"] = (skipped, undo)
        self._steps.before_next_step(self.settle)

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
        self.settle()  # whoever reads the scheduler sees where it is, not where it may be taken back from
        return getattr(self._scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.settle()
        setattr(self._scheduler, name, value)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _settles(wrapper: weakref.ref[SkipAwareScheduler]) -> Callable[[Any], None]:
    """An optimizer state-dict pre-hook that settles the wrapper's pending advance, while it lives."""

    def hook(optimizer: Any) -> None:
        alive = wrapper()
        if alive is not None:
            alive.settle()

    return hook


def hold_step_schedulers(configs: Iterable[Any], steps: _StepSkips, lr_on_skip: str) -> None:
    """Wrap each step-interval scheduler of ``configs`` in a :class:`SkipAwareScheduler` (once).

    ``configs`` are Lightning's ``LRSchedulerConfig``s (their ``scheduler`` and ``interval``), in
    automatic and manual optimization alike; epoch-interval schedulers are left as they are.
    """
    for config in configs:
        held = isinstance(config.scheduler, SkipAwareScheduler)
        if getattr(config, "interval", "step") == "step" and not held:
            config.scheduler = SkipAwareScheduler(config.scheduler, steps, lr_on_skip)
