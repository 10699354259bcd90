"""SkipAwareScheduler without a Trainer: it steps, holds or advances as told; it copies and pickles."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch

from amp_plugin import AMPPrecision
from amp_plugin.schedulers import SkipAwareScheduler

ORDER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


class _Plugin:
    """What the wrapper reads of the plugin's step driver (and the plugin's lr_on_skip), scripted."""

    def __init__(self, skipped: bool, lr_on_skip: str = "hold") -> None:
        self.skipped, self.lr_on_skip = skipped, lr_on_skip
        self.asked: list[Any] = []

    @property
    def last_step_skipped(self) -> bool:
        return self.skipped

    def step_skipped(self, optimizer: Any) -> bool:
        self.asked.append(optimizer)
        return self.skipped

    def known_skip(self, optimizer: Any) -> bool | None:
        self.asked.append(optimizer)
        return self.skipped


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)


def _wrapped(plugin: Any, optimizer: torch.optim.Optimizer | None = None) -> SkipAwareScheduler:
    opt = optimizer or _optimizer()
    steps = plugin.driver if isinstance(plugin, AMPPrecision) else plugin
    return SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), steps, plugin.lr_on_skip)


def test_a_taken_step_steps_the_scheduler_and_asks_about_its_own_optimizer() -> None:
    opt = _optimizer()
    plugin = _Plugin(skipped=False)
    scheduler = _wrapped(plugin, opt)
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5] and scheduler.last_epoch == 1
    assert plugin.asked == [opt]


def test_a_skipped_step_holds_the_scheduler() -> None:
    scheduler = _wrapped(_Plugin(skipped=True))
    scheduler.step()
    assert scheduler.get_last_lr() == [1.0] and scheduler.last_epoch == 0


def test_advance_steps_a_skipped_step_without_the_order_warning() -> None:
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler\.step\(\)`"):
        torch.optim.lr_scheduler.StepLR(_optimizer(), 1).step()  # the warning it keeps away
    scheduler = _wrapped(_Plugin(skipped=True, lr_on_skip="advance"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    assert not [w for w in caught if ORDER_WARNING in str(w.message)]
    assert scheduler.get_last_lr() == [0.5]


@pytest.mark.parametrize("skipped", [True, False])
def test_a_scheduler_without_an_optimizer_follows_the_last_step(skipped: bool) -> None:
    class Counter:  # a duck-typed scheduler: no .optimizer
        steps = 0

        def step(self) -> None:
            self.steps += 1

    plugin = _Plugin(skipped)
    scheduler = SkipAwareScheduler(Counter(), plugin, plugin.lr_on_skip)
    scheduler.step()
    assert scheduler.steps == (0 if skipped else 1) and plugin.asked == []


def test_everything_but_step_is_the_wrapped_schedulers() -> None:
    inner = torch.optim.lr_scheduler.StepLR(_optimizer(), 1, gamma=0.5)
    scheduler = SkipAwareScheduler(inner, _Plugin(skipped=False))
    scheduler.gamma = 0.25
    assert inner.gamma == 0.25 and "gamma" not in vars(scheduler)
    assert scheduler.state_dict() == inner.state_dict()
    with pytest.raises(AttributeError):
        scheduler.__wrapped__  # noqa: B018  # dunders are never forwarded (copy and pickle probe them)


# torch's own note on a copied optimizer: the copy's step() lost the scheduler's step counter.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_the_wrapper_copies_and_pickles_with_its_plugin(how: str) -> None:
    scheduler = _wrapped(AMPPrecision("16-mixed", device="cpu"))
    clone = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    }[how](scheduler)
    assert type(clone) is SkipAwareScheduler
    assert clone.state_dict() == scheduler.state_dict()
    assert clone.get_last_lr() == scheduler.get_last_lr()
    clone.optimizer.step()
    clone.step()  # still a working scheduler
    assert clone.last_epoch == 1


class _FusedPlugin(_Plugin):
    """A fused optimizer: its skip flag stays on the device until someone asks ``step_skipped``."""

    def __init__(self, skips: list[bool], lr_on_skip: str = "hold") -> None:
        super().__init__(False, lr_on_skip)
        self.skips, self.reads = skips, 0

    def known_skip(self, optimizer: Any) -> bool | None:
        return None

    def step_skipped(self, optimizer: Any) -> bool:
        self.reads += 1
        return self.skips.pop(0)


def test_with_a_fused_optimizer_the_scheduler_holds_on_the_skipped_step_with_one_read() -> None:
    plugin = _FusedPlugin([False, True, False])
    scheduler = _wrapped(plugin)
    epochs = []
    for _ in range(3):
        scheduler.step()
        epochs.append(scheduler.last_epoch)
    assert epochs == [1, 1, 2] and plugin.reads == 3  # held on the skipped step itself


def test_advance_never_reads_a_fused_flag() -> None:
    plugin = _FusedPlugin([True], lr_on_skip="advance")
    scheduler = _wrapped(plugin)
    scheduler.step()
    assert scheduler.last_epoch == 1 and plugin.reads == 0


def test_a_bad_lr_on_skip_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lr_on_skip='later'.*HINT"):
        SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(_optimizer(), 1), _Plugin(False), "later")


@pytest.mark.parametrize(
    ("scheduler", "match"),
    [
        (None, r"scheduler=None.*HINT: pass the LR scheduler"),
        (_optimizer(), r"scheduler=SGD.*an optimizer.*HINT: pass the LR scheduler"),
    ],
)
def test_what_is_not_a_scheduler_is_refused_at_once(scheduler: Any, match: str) -> None:
    # Accepted before, an optimizer was stepped again by every scheduler.step() of the wrapper.
    with pytest.raises(TypeError, match=match):
        SkipAwareScheduler(scheduler, _Plugin(False))
