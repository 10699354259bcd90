"""SkipAwareScheduler without a Trainer: it steps, holds or advances as told; it copies and pickles."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from amp_plugin import AMPPrecision
from amp_plugin._schedulers import SkipAwareScheduler

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

    def deferred_skip(self, optimizer: Any) -> bool | Callable[[], bool]:
        return self.step_skipped(optimizer)  # a CPU flag: known at once

    def before_next_step(self, callback: Callable[[], None]) -> None:
        raise AssertionError("nothing is left for the next step when the flag is known")


class _DeviceFlags(_FusedPlugin):
    """A fused optimizer's flag on an accelerator: known only once read, which the test does by hand."""

    def __init__(self, skips: list[bool]) -> None:
        super().__init__(skips)
        self.waiting: list[Callable[[], None]] = []

    def deferred_skip(self, optimizer: Any) -> bool | Callable[[], bool]:
        skipped = self.skips.pop(0)

        def read() -> bool:
            self.reads += 1
            return skipped

        return read

    def before_next_step(self, callback: Callable[[], None]) -> None:
        self.waiting.append(callback)

    def next_step(self) -> None:
        """What the step driver does as the next optimizer step starts."""
        waiting, self.waiting = self.waiting, []
        for callback in waiting:
            callback()


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


def _one_cycle(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20, pct_start=0.3)


def _adamw() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=1.0)


def test_a_device_flag_is_read_at_the_next_step_and_a_skipped_steps_advance_taken_back() -> None:
    """The LR each step uses, the scheduler's state and the groups match a hold that read at once.

    OneCycleLR moves AdamW's betas too (cycle_momentum): the groups are restored whole.
    """
    skips = [False, True, True, False, True, False, False, True, False, False]
    held_opt, lazy_opt = _adamw(), _adamw()
    held = SkipAwareScheduler(_one_cycle(held_opt), _FusedPlugin(list(skips)))
    device = _DeviceFlags(list(skips))
    lazy = SkipAwareScheduler(_one_cycle(lazy_opt), device)
    for step in range(len(skips)):
        device.next_step()  # the next optimizer step starts: the last flag is read now
        assert lazy_opt.param_groups[0]["lr"] == held_opt.param_groups[0]["lr"], step
        assert lazy_opt.param_groups[0]["betas"] == held_opt.param_groups[0]["betas"], step
        held.step()
        lazy.step()  # advances at once: nothing read
        assert device.reads == step
    assert lazy.state_dict() == held.state_dict()  # reading the scheduler settles the last step
    assert device.reads == len(skips)
    assert lazy_opt.state_dict()["param_groups"] == held_opt.state_dict()["param_groups"]


def test_the_optimizers_state_dict_settles_first_as_a_checkpoint_saves_it_before_the_scheduler() -> None:
    opt = _adamw()
    device = _DeviceFlags([True])
    scheduler = SkipAwareScheduler(_one_cycle(opt), device)
    first_lr = opt.param_groups[0]["lr"]
    scheduler.step()
    assert opt.param_groups[0]["lr"] != first_lr  # advanced, not yet known to be skipped
    assert opt.state_dict()["param_groups"][0]["lr"] == first_lr and device.reads == 1
    assert scheduler.last_epoch == 0


def test_a_second_scheduler_step_before_the_next_optimizer_step_settles_the_first() -> None:
    opt = _adamw()
    device = _DeviceFlags([True, False])
    scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), device)
    scheduler.step()
    scheduler.step()  # manual optimization may do this; the first advance is settled at once
    device.next_step()
    assert scheduler.last_epoch == 1 and device.reads == 2


def test_a_wrapper_with_a_pending_advance_pickles_settled() -> None:
    opt = _adamw()
    scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), _DeviceFlags([True]))
    scheduler.step()
    clone = pickle.loads(pickle.dumps(scheduler, protocol=pickle.HIGHEST_PROTOCOL))
    assert clone.last_epoch == 0 and clone.get_last_lr() == [1.0]


@pytest.mark.cuda
def test_on_cuda_the_hold_leaves_the_gpu_running_and_still_holds_a_skipped_step() -> None:
    """The scheduler steps while the GPU is still busy with the step (no wait), and is exact after."""
    from torch import nn

    from amp_plugin import LossScaler
    from amp_plugin._step import StepDriver

    driver = StepDriver(LossScaler("cuda", init_scale=1.0, dynamic=False))  # the guard
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), driver, "hold")
    lrs = []
    for step in range(4):
        driver.scaler.scale(model(torch.randn(8, 64, device="cuda")).sum()).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU work ahead of the step
        # A synchronising call raises, from step 1 on: step 0 creates the optimizer state and the
        # guard's flags, which copy Python numbers to the GPU.
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            driver.step(opt, lambda: False)
            lrs.append(opt.param_groups[0]["lr"])  # settled at the step's start: the LR it runs with
            scheduler.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # Still busy with the sleep: nothing waited (step 0's copies of Python numbers do wait).
        assert step == 0 or not torch.cuda.current_stream().query(), "the scheduler waited for the GPU"
        opt.zero_grad()
    torch.cuda.synchronize()
    assert lrs == [1.0, 0.5, 0.5, 0.25]  # step 1 was skipped: step 2 runs with its LR
    assert scheduler.last_epoch == 3 and driver.scaler.skipped_steps == 1


def test_taking_an_advance_back_keeps_what_was_set_by_hand_since() -> None:
    opt = _adamw()
    device = _DeviceFlags([True])
    scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), device)
    scheduler.step()  # advanced: lr 0.5, not yet known to be skipped
    opt.param_groups[0]["weight_decay"] = 0.5  # the user's own change, after the scheduler's step
    device.next_step()  # skipped: the scheduler's change goes back, the user's stays
    assert opt.param_groups[0]["lr"] == 1.0 and opt.param_groups[0]["weight_decay"] == 0.5
