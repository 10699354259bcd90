"""The step driver: the control flow of one guarded optimizer step, shared by every adapter.

Lightning's Trainer plugin, Fabric's plugin and ``AMPFSDPPrecision`` differ in which hooks run
between backward and the optimizer step; the order around those hooks is the same for all and
lives here once, in plain torch:

1. ``training_step`` returned ``None``: the hooks run (without clipping), nothing steps, and the
   batch counts as not stepped (its step-interval scheduler holds).
2. The half-precision gradients move into fp32 masters, if the model has them.
3. In manual optimization an optimizer may step again after another backward (a WGAN critic):
   it is re-armed.
4. Unless the caller takes the fast clipping path, the gradients are unscaled (and checked)
   before the hooks, so that the hooks see unscaled gradients.
5. The hooks run (``on_before_optimizer_step``, clipping).
6. If a hook could have changed the gradients after the check, one read-only pass checks them
   again (a norm clip checked them already).
7. :meth:`LossScaler.step` steps, unless a gradient (or the loss) was inf/NaN: non-fused
   optimizers are skipped on the host after one read of the flag, fused ones inside their kernel.
8. The scale is updated (once per batch: in manual optimization after every optimizer's step).

Every precision runs this with a :class:`~amp_plugin.LossScaler`: fp16 with a loss-scaling one,
bf16/fp32 and the "-true" precisions with a guard (a static scale of 1, which scales nothing and
checks the gradients read-only). The driver keeps the skip flag that the scaler already read (or
the device flag, for fused optimizers) so that schedulers and monitors never read it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from amp_plugin import _clipping as clipping
from amp_plugin._distributed import global_norm
from amp_plugin._optim import unwrap_optimizer
from amp_plugin._scaler import LossScaler
from amp_plugin._sharding import ShardAwareKernels
from amp_plugin.kernels import Backend, get_kernels

__all__ = ["StepDriver", "read_flags", "stacked_flags"]

Skip = bool | Tensor  # a host bool where the scaler read the flag, else the device flag (> 0: skipped)


class StepDriver:
    """Runs one optimizer step in the guarded order; remembers which steps were skipped.

    Args:
        scaler: the loss scaler or guard that checks and skips; ``None`` runs the steps unguarded
            (only where the user turned the guard off).
        before_step: called with the real optimizer before anything reads its gradients
            (e.g. moving half gradients into fp32 master weights).
        kernels: the kernel backend of the clips and norms when no scaler runs.
        before_read: called with the real optimizer before a clip, a norm or the hooks read the
            gradients' values (remainder masters make their fp32 gradients there; the inf check
            before the step needs no such call).
        sharded: the gradients are this rank's shard of plain tensors (FSDP1): the norms it
            clips by and records (:attr:`last_grad_norm`) are those of every rank's shard.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> driver = StepDriver(LossScaler("cpu", init_scale=1.0, dynamic=False))  # a guard
        >>> for value in (1.0, float("nan")):
        ...     loss = driver.scaler.scale(model(torch.full((1, 2), value)).sum())
        ...     loss.backward()
        ...     _ = driver.step(opt, lambda: False)
        ...     opt.zero_grad()
        >>> driver.last_step_skipped, driver.scaler.skipped_steps, driver.scaler.total_steps
        (True, 1, 2)
    """

    def __init__(
        self,
        scaler: LossScaler | None,
        before_step: Callable[[Any], None] | None = None,
        kernels: Backend = "auto",
        before_read: Callable[[Any], None] | None = None,
        *,
        sharded: bool = False,
    ) -> None:
        self.scaler = scaler
        self.before_step = before_step
        self.kernels = kernels
        self.before_read = before_read
        self.sharded = sharded
        #: The unscaled total norm of the gradients before clipping, of this batch's latest step:
        #: what a norm clip computed, or what :meth:`request_grad_norm` asked for; ``None`` else.
        self.last_grad_norm: Tensor | None = None
        self._want_norm = False  # request_grad_norm() was called for the next step
        self._checked = False  # a clip checked the gradients after the hooks of the step running now
        self._skips: dict[int, Skip] = {}  # id(real optimizer) -> whether its latest step was skipped
        self._last: Skip | None = None  # the latest step's flag, until the batch's scale update
        self._stepped_since_backward: set[int] = set()  # optimizers that may not step again yet
        self._stepped_in_batch = False
        self._in_batch: list[Skip] = []  # the flags of this batch's steps, until its scale update
        self._batch: Skip = False  # whether the last updated batch skipped a step
        self._before_next: list[Callable[[], None]] = []  # run once, before the next step of any optimizer

    def begin_batch(self) -> None:
        """A training batch starts: forget the previous batch's :attr:`last_grad_norm`."""
        self.last_grad_norm = None

    def request_grad_norm(self) -> None:
        """Have the next step record :attr:`last_grad_norm` even without a norm clip (one read)."""
        self._want_norm = True

    def backward(
        self, loss: Any, run: Callable[..., Any], *args: Any, seedable: bool = True, **kwargs: Any
    ) -> None:
        """Backward from ``loss`` through the adapter's backward call ``run(loss, *args, **kwargs)``.

        The scaler scales it (and makes the gradients NaN for an inf/NaN loss). Where ``run``
        hands ``gradient=`` on to ``loss.backward`` (``seedable``) and nothing else asks for a
        ``gradient``, a one-element loss is not scaled: backward starts from
        :meth:`LossScaler.backward_seed` instead: the same gradients, in fewer launches.
        Afterwards every optimizer may step (again) on its gradients.
        """
        self._stepped_since_backward.clear()
        guard = self.scaler
        if guard is None:
            run(loss, *args, **kwargs)
        elif (  # what backward() starts from without a gradient: a one-element float loss
            seedable
            and not args
            and "gradient" not in kwargs
            and isinstance(loss, Tensor)
            and loss.requires_grad
            and loss.is_floating_point()
            and loss.numel() == 1
        ):
            run(loss, gradient=guard.backward_seed(loss), **kwargs)
        else:
            with torch.enable_grad():  # backward under no_grad works in torch: the product must track
                scaled = guard.scale(loss)
            run(scaled, *args, **kwargs)

    def not_stepped(self, optimizer: Any, run_hooks: Callable[[], Any]) -> None:
        """``training_step`` returned ``None``: run the hooks; nothing steps; the batch counts as skipped."""
        opt = unwrap_optimizer(optimizer)
        self.settle()
        run_hooks()
        self._want_norm, self.last_grad_norm = False, None  # no step: no norm of it
        if self.scaler is not None:
            self.scaler.forget(opt)  # nothing of this batch may be taken for the next one's state
        # Holds its scheduler; no scale update follows, so it is no part of the next batch's flags.
        self._skips[id(opt)] = self._last = True

    def step(
        self,
        optimizer: Any,
        run_hooks: Callable[[], object],
        *,
        observe_unscaled: bool = True,
        update: bool = True,
        hooks_read: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer`` unless its gradients (or the loss) are inf/NaN; return the step's result.

        Args:
            optimizer: the optimizer (a wrapper is unwrapped once, here).
            run_hooks: runs what may look at or change the gradients before the step (hooks, and
                clipping through :meth:`clip_grad_norm_` / :meth:`clip_grad_value_`, whose check
                of the gradients after the hooks spares the recheck).
            observe_unscaled: unscale before ``run_hooks``, so that they see unscaled gradients,
                and check again after them; ``False`` is the fast clipping path.
            update: update the scale now (automatic optimization); ``False`` waits for
                :meth:`end_batch` (manual optimization, several optimizers per batch).
            hooks_read: ``run_hooks`` may read gradient values (a user's hook); ``False`` where
                only this driver's clips do, which ask :attr:`before_read` themselves.
            kwargs: passed on to ``optimizer.step``.
        """
        opt = unwrap_optimizer(optimizer)
        self.settle()
        if self.before_step is not None:
            self.before_step(opt)
        if hooks_read:
            self._read(opt)
        scaler = self.scaler
        if scaler is None:
            self._run_hooks(opt, run_hooks)
            return optimizer.step(**kwargs)
        stage = self._arm(scaler, opt)
        # A guard has nothing to unscale: its one check runs after the hooks (in a clip, or in step).
        observe_unscaled = observe_unscaled and not scaler.is_guard
        if observe_unscaled and stage == "ready":
            scaler.unscale_(opt)  # the hooks below see unscaled gradients
        checked = self._run_hooks(opt, run_hooks)
        if observe_unscaled and not checked:
            scaler.recheck_(opt)  # a hook may have written inf/NaN after unscale_
        result = scaler.step(optimizer, **kwargs)
        flag = scaler.step_skipped(opt)
        self._record(opt, False if flag is None else flag)
        if update:
            self._update()
        else:
            self._stepped_in_batch = True
        return result

    def _run_hooks(self, opt: Any, run_hooks: Callable[[], object]) -> bool:
        """Run the hooks; record a requested norm no clip computed; whether a clip checked the gradients."""
        self._checked = False
        run_hooks()
        self._take_requested_norm(opt)
        self._want_norm = False
        return self._checked

    def _take_requested_norm(self, optimizer: Any) -> None:
        """Record the norm :meth:`request_grad_norm` asked for, unless a clip computed it already."""
        if self._want_norm and self.last_grad_norm is None:
            self.last_grad_norm = self.grad_norm(optimizer)

    def end_batch(self) -> None:
        """Close a batch of manual optimization: one scale update after all of its steps."""
        if self._stepped_in_batch:
            self._stepped_in_batch = False
            self._update()

    def clip_grad_norm_(self, optimizer: Any, max_norm: float) -> Tensor:
        """Clip by the unscaled total norm (through the scaler: no extra pass for its check); return it.

        The norm is kept as :attr:`last_grad_norm`; with a scaler, the clip checked the gradients.
        """
        opt = unwrap_optimizer(optimizer)
        self._read(opt)
        if self.scaler is not None:
            norm = self.scaler.clip_grad_norm_(opt, max_norm, sharded=self.sharded)
            self._checked = True
        else:
            grads = clipping.gradients(opt.param_groups)
            norm = clipping.clip_grad_norm_(self._kernels_for(grads), grads, max_norm).total_norm
        self.last_grad_norm = norm
        return norm

    def clip_grad_value_(self, optimizer: Any, clip_value: float) -> None:
        """Clamp every unscaled gradient element to ``[-clip_value, clip_value]``.

        A requested :attr:`last_grad_norm` is taken first (the norm before the clip).
        """
        self._take_requested_norm(optimizer)
        self._read(unwrap_optimizer(optimizer))
        if self.scaler is not None:
            self.scaler.clip_grad_value_(optimizer, clip_value)
            self._checked = True  # the clip checked the gradients before clamping them
            return
        params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_value)

    def grad_norm(self, optimizer: Any) -> Tensor:
        """The total norm of the unscaled gradients (every rank's shard, if sharded), untouched (one read)."""
        self._read(unwrap_optimizer(optimizer))
        if self.scaler is not None:
            norm = self.scaler.grad_norm(optimizer)
        else:
            grads = clipping.gradients(unwrap_optimizer(optimizer).param_groups)
            norm = self._kernels_for(grads).norm(grads)
        if not self.sharded:
            return norm
        return global_norm(norm, 2.0, None if self.scaler is None else self.scaler.process_group)

    def _read(self, opt: Any) -> None:
        if self.before_read is not None:
            self.before_read(opt)

    def _kernels_for(self, grads: list[Tensor]) -> ShardAwareKernels:
        return ShardAwareKernels(get_kernels(self.kernels, grads[0].device if grads else None))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step was skipped; after the batch's update, whether any step of it was."""
        return bool(self.last_skip)  # a device flag is read here, on request only

    def step_skipped(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s latest step was skipped (or not taken); ``False`` before its first.

        A fused step's device flag is read here once (a host read) and kept as a bool from then on.
        """
        key = id(unwrap_optimizer(optimizer))
        flag = self._skips.get(key, False)
        if isinstance(flag, bool):
            return flag
        value = bool(flag)
        self._skips[key] = value
        if self._last is flag:
            self._last = value
        if self._batch is flag:
            self._batch = value
        return value

    def known_skip(self, optimizer: Any) -> bool | None:
        """:meth:`step_skipped` where it is known without a host read; ``None`` for a fused step's flag."""
        flag = self._skips.get(id(unwrap_optimizer(optimizer)), False)
        return flag if isinstance(flag, bool) else None

    def deferred_skip(self, optimizer: Any) -> bool | Callable[[], bool]:
        """:meth:`step_skipped` without waiting for the device: a bool where it is known now, else a function.

        A host bool is known, and so is a CPU flag (a CPU op has finished when it returns). A flag
        on a CUDA device starts on its way to pinned host memory behind the step's kernels, and
        the returned function waits for that copy alone: called once the next step's work is
        queued, it finds it done, where :meth:`step_skipped` would wait for everything queued.
        (On other accelerators the flag is read at once.)
        """
        flag = self._skips.get(id(unwrap_optimizer(optimizer)), False)
        if isinstance(flag, bool) or flag.device.type != "cuda":
            return self.step_skipped(optimizer)
        host = flag.to("cpu", non_blocking=True)  # into pinned memory, on the flag device's current stream
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flag.device))

        def skipped() -> bool:
            done.synchronize()
            return bool(host)

        return skipped

    def before_next_step(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once, as the next :meth:`step` (or :meth:`not_stepped`, :meth:`settle`) starts."""
        self._before_next.append(callback)

    def settle(self) -> None:
        """Run now what waits for the next step (a held scheduler's check of a fused step's flag).

        The next :meth:`step` does it first; the plugins call it as a fit ends, so that nothing
        is left pending after the last step.
        """
        callbacks, self._before_next = self._before_next, []
        for callback in callbacks:
            callback()

    @property
    def skipped_steps_seen(self) -> int:
        """The scaler's skipped steps as last known on the host (:attr:`LossScaler.skipped_steps_seen`)."""
        return 0 if self.scaler is None else self.scaler.skipped_steps_seen

    @property
    def last_skip(self) -> Skip:
        """:attr:`last_step_skipped` without a host read: a bool, or a 0-dim device flag (> 0: skipped)."""
        if self._last is not None:
            return self._last
        return self._batch

    def _record(self, opt: Any, skipped: Skip) -> None:
        self._skips[id(opt)] = self._last = skipped
        self._in_batch.append(skipped)

    def _update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()
        flags, self._in_batch = self._in_batch, []
        if len(flags) == 1:  # automatic optimization: the batch's one step
            self._batch = flags[0]
        elif any(f is True for f in flags) or all(isinstance(f, bool) for f in flags):
            self._batch = any(f is True for f in flags)  # known on the host: nothing to launch
        else:  # the device flags only (a host False adds nothing, and would be a host-to-device copy)
            self._batch = cast(Tensor, stacked_flags([f for f in flags if isinstance(f, Tensor)])).amax()
        self._last = None  # from here on last_step_skipped describes the whole batch

    def _arm(self, scaler: LossScaler, opt: Any) -> str:
        """Let manual optimization step an optimizer again in a batch (a WGAN critic), after a backward.

        Returns the optimizer's stage from here on (``"ready"`` once re-armed).
        """
        key = id(opt)
        stage = scaler.stage(opt)
        if stage == "stepped":
            if key in self._stepped_since_backward:
                raise RuntimeError(
                    f"{type(opt).__name__} was stepped twice in one training_step with no backward in "
                    "between, under a loss scaler or guard: the first step used the gradients. HINT: "
                    "call manual_backward (and zero_grad) before each step of the same optimizer."
                )
            scaler.rearm(opt)  # skipped on its own gradients; one scale update per batch
            stage = "ready"
        self._stepped_since_backward.add(key)
        return stage


def stacked_flags(flags: Sequence[Skip]) -> Tensor | None:
    """Skip flags as one fp32 tensor on the device of the first device flag; ``None`` without one.

    One launch for the lot, however many steps they come from (host bools among them are copied
    over). The step driver reduces it to a batch's flag, the monitor reads it once.

    Example:
        >>> stacked_flags([torch.tensor(1.0), False]).tolist(), stacked_flags([True, False])
        ([1.0, 0.0], None)
    """
    device = next((f.device for f in flags if isinstance(f, Tensor)), None)
    if device is None:
        return None
    return torch.stack([torch.as_tensor(f, dtype=torch.float32, device=device) for f in flags])


def read_flags(flags: Sequence[Skip]) -> list[bool]:
    """The skip flags as bools, with one host read for all the device flags among them (none if none).

    Example:
        >>> read_flags([torch.tensor(0.0), True, torch.tensor(1.0)])
        [False, True, True]
    """
    stacked = stacked_flags(flags)
    if stacked is None:
        return [bool(f) for f in flags]
    return [v > 0 for v in stacked.tolist()]
