"""What each optimizer has done in the current loss-scaling iteration (between two ``update()`` calls).

Per optimizer (keyed on the real optimizer, never a wrapper) torch's state machine runs
READY -> UNSCALED -> STEPPED. Each state remembers the optimizer's inf flag, the factor
its gradients still carry (a clip folded into a fused optimizer), and whether the flag was
already agreed across ranks. :class:`~amp_plugin.LossScaler` drives it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Iteration", "OptimizerState", "Stage"]


class Stage(enum.Enum):
    """Where an optimizer stands: gradients still scaled, unscaled (or clipped), or stepped."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class OptimizerState:
    """One optimizer's part of the iteration."""

    stage: Stage = Stage.READY
    found_inf: Tensor | None = None
    grad_scale: Tensor | None = None  # the factor the grads still carry once stage is UNSCALED
    synced: bool = False  # found_inf already agreed across ranks (all-reduced, or from a global norm)
    skipped: bool | None = None  # found_inf as read on the host by a non-fused step(), else None

    def merge_inf(self, flag: Tensor, agreed: bool) -> None:
        """Fold a later inf check (``flag`` > 0: overflow) into this optimizer's flag.

        ``agreed``: ``flag`` is the same on every rank already (it came from a global norm).
        """
        if self.found_inf is None or self.stage is Stage.READY:
            self.found_inf, self.synced = flag, agreed
            return
        torch.maximum(self.found_inf, flag.to(self.found_inf), out=self.found_inf)
        self.synced = self.synced and agreed


class Iteration:
    """The states of the optimizers touched since the last ``update()``.

    Example:
        >>> it = Iteration()
        >>> it.open(1).stage = Stage.UNSCALED
        >>> it.stage(1), it.stage(2), it.in_flight()
        (<Stage.UNSCALED: 1>, <Stage.READY: 0>, True)
    """

    def __init__(self) -> None:
        self.states: dict[int, OptimizerState] = {}
        self.retired: list[Tensor] = []  # inf flags of steps taken before an optimizer was re-armed
        self.scaled = False  # scale() ran since the last update(): gradients in flight carry the scale

    def get(self, key: int) -> OptimizerState | None:
        """The state of the optimizer with ``id`` ``key``, if it was touched."""
        return self.states.get(key)

    def open(self, key: int) -> OptimizerState:
        """The state of the optimizer with ``id`` ``key``, created READY on first touch."""
        return self.states.setdefault(key, OptimizerState())

    def stage(self, key: int) -> Stage:
        """Where that optimizer stands (READY when untouched)."""
        state = self.states.get(key)
        return Stage.READY if state is None else state.stage

    def in_flight(self) -> bool:
        """Whether anything happened since the last ``update()``: the gradients carry the scale."""
        return self.scaled or bool(self.states) or bool(self.retired)

    def flags(self, agree: Callable[[OptimizerState], None]) -> list[Tensor]:
        """Every inf flag of the iteration, each agreed across ranks first (``agree``)."""
        for state in self.states.values():  # unscaled or clipped but never stepped: agree on it here
            agree(state)
        return [s.found_inf for s in self.states.values() if s.found_inf is not None] + self.retired

    def skipped_on_host(self) -> bool | None:
        """Whether any step of the iteration was skipped, if every step read its flag; else ``None``."""
        states = self.states.values()
        if self.retired or not states or any(s.skipped is None for s in states):
            return None
        return any(s.skipped for s in states)

    def rearm(self, key: int, agree: Callable[[OptimizerState], None]) -> None:
        """Let that optimizer run READY -> STEPPED again; its flag so far still counts for ``update()``."""
        state = self.states.pop(key, None)
        if state is not None and state.found_inf is not None:
            agree(state)
            self.retired.append(state.found_inf)

    def forget(self, key: int) -> None:
        """Drop that optimizer's state: its gradients will not be stepped."""
        self.states.pop(key, None)

    def clear(self) -> None:
        """Start the next iteration."""
        self.states.clear()
        self.retired.clear()
        self.scaled = False
