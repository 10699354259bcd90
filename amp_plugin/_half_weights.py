"""Half-precision weights under ``AMPPrecision``: fp32 master weights, or pure half with a rounding.

:class:`HalfWeights` is what both ``AMPPrecision`` plugins (the Trainer's and Fabric's) do with
:mod:`amp_plugin.master_weights` and :mod:`amp_plugin.rounded_updates`: it casts the model when
the plugin is asked to convert it (before DDP wraps it), hands the optimizers to the masters or
the rounding hooks, moves gradients before each step, and keeps the rounding generator in
checkpoints. The fp32 master values reach every checkpoint through the model's own
``state_dict`` (see :meth:`MasterWeights.hook`), weights-only ones included, for which Lightning
asks the precision plugin nothing. Plain torch: nothing here imports Lightning.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from amp_plugin._optim import unwrap_optimizer
from amp_plugin.grad_accumulation import Fp32GradAccumulation
from amp_plugin.master_weights import NORM_LAYERS, MasterMode, MasterWeights, cast_model
from amp_plugin.rounded_updates import RoundedUpdates, Rounding

__all__ = ["HalfWeights"]


class HalfWeights:
    """What ``AMPPrecision`` does to hold a model's weights in fp16/bf16.

    Args:
        master_weights: keep fp32 masters that the optimizer steps ("-mixed" precisions);
            ``"remainder"`` keeps them as bf16 weights plus int16 remainders; ``False`` holds the
            weights in half only ("-true" precisions).
        keep_fp32: module classes whose tensors stay fp32; ``None`` means the normalization
            layers with master weights and nothing without (as Lightning's "-true" and Apex's O3).
        rounding: how updates are written into half weights without masters.
        seed: the stochastic rounding's seed.

    Example:
        >>> weights = HalfWeights(master_weights=True)
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> weights.convert(model, torch.bfloat16)
        >>> model[0].weight.dtype, model[1].weight.dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        master_weights: MasterMode,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        rounding: Rounding = "nearest",
        seed: int = 0,
    ) -> None:
        self.master_weights = master_weights
        default = NORM_LAYERS if master_weights else ()
        self.keep_fp32 = tuple(keep_fp32) if keep_fp32 is not None else default
        self.rounding: Rounding = rounding
        self.seed = seed
        self.masters: MasterWeights | None = None
        self._rounders: dict[int, RoundedUpdates] = {}  # in attach order
        self._rng_states: list[Any] = []  # loaded before the optimizers exist
        self._module: weakref.ref[nn.Module] | None = None
        self._accumulation: Fp32GradAccumulation | None = None  # while accumulate_in_fp32(True)
        self._flush_pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (half param, where its sum goes)

    def __getstate__(self) -> dict[str, Any]:
        # A spawned process gets a pickled copy: a weak reference does not pickle, the model does (it
        # travels in the same pickle as a rule, so the copy knows its copy of the model as converted).
        state = dict(self.__dict__)
        state["_module"] = None if self._module is None else self._module()
        # Hooks on the parameters do not travel: the copy's adapter turns accumulation on again.
        state["_accumulation"], state["_flush_pairs"] = None, []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        module = state.pop("_module")
        self.__dict__.update(state)
        self._module = None if module is None else weakref.ref(module)

    def convert(
        self, module: nn.Module, dtype: torch.dtype, extra_fp32: Sequence[type[nn.Module]] = ()
    ) -> None:
        """Cast ``module`` in place (once: a second fit of the same model keeps its masters)."""
        if self._module is not None and self._module() is module:
            return
        self.masters = cast_model(
            module, dtype, (*self.keep_fp32, *extra_fp32), master_weights=self.master_weights
        )
        self._module = weakref.ref(module)

    def converted(self, module: nn.Module) -> bool:
        """Whether :meth:`convert` cast ``module`` (or the model it is part of)."""
        model = None if self._module is None else self._module()
        return model is not None and (model is module or any(m is module for m in model.modules()))

    def attach(self, optimizers: Sequence[Any]) -> None:
        """Hand each optimizer to the masters, or to the rounding hooks."""
        for optimizer in optimizers:
            if self.master_weights and self.masters is not None:
                self.masters.attach(optimizer)
            elif self.rounding != "nearest":
                opt = unwrap_optimizer(optimizer)
                if id(opt) not in self._rounders:
                    rounder = RoundedUpdates(opt, self.rounding, seed=self.seed)
                    if len(self._rng_states) > len(self._rounders):
                        rounder.load_state_dict(self._rng_states[len(self._rounders)])
                    self._rounders[id(opt)] = rounder

    def accumulate_in_fp32(self, enabled: bool, ddp: Any = None) -> None:
        """Add micro-batch gradients up in fp32 (``True``) or in the half ``.grad`` (``False``).

        Turn it on where several backward passes run per optimizer step (gradient accumulation):
        each trainable half parameter's gradient then moves into an fp32 sum after every backward
        (4 bytes per parameter, held until the step; see :mod:`amp_plugin.grad_accumulation`), and
        :meth:`before_step` hands the step the sum: as the masters' fp32 ``.grad``, or rounded once
        into the half ``.grad`` without masters. Call it after :meth:`convert`. With ``ddp`` (the
        model's ``DistributedDataParallel``, before its first backward) DDP averages the fp32 sums
        across ranks instead of the half ``.grad``; where ``ddp`` has a comm hook already, the
        ``RuntimeError`` comes with accumulation left off.
        """
        if self._accumulation is not None:
            self._accumulation.remove()
            self._accumulation, self._flush_pairs = None, []
        module = self._module() if self._module is not None else None
        if not enabled or module is None:
            return
        params = list(module.parameters())
        accumulation = Fp32GradAccumulation(params)
        if ddp is not None:
            try:
                accumulation.reduce_across(ddp)
            except RuntimeError:  # DDP takes one comm hook: leave nothing hooked, then say why
                accumulation.remove()
                raise
        self._accumulation = accumulation
        masters = self.masters if self.master_weights else None
        for param in params:
            master = masters.master_of(param) if masters is not None else None
            self._flush_pairs.append((param, master if master is not None else param))

    def flush_gradients(self, optimizer: Any) -> None:
        """Hand ``optimizer``'s parameters their fp32 gradient sums (no-op unless accumulating)."""
        if self._accumulation is None or not self._accumulation.pending():
            return
        if self.masters is not None and self.masters.remainder:  # the sums go to fp32 masters
            self.masters.fp32_grads(optimizer)
        stepped = {id(p) for group in unwrap_optimizer(optimizer).param_groups for p in group["params"]}
        self._accumulation.flush_([pair for pair in self._flush_pairs if id(pair[1]) in stepped])

    def before_step(self, optimizer: Any) -> None:
        """Hand over the fp32 gradient sums, then move the half gradients into the masters."""
        self.flush_gradients(optimizer)
        if self.master_weights and self.masters is not None:
            self.masters.grads_to_master(optimizer, defer=True)  # grads_in_fp32 before any read

    def grads_in_fp32(self, optimizer: Any) -> None:
        """Make ``optimizer``'s gradients fp32 now, before something reads their values.

        Remainder masters keep the model's bf16 gradients until the step's pre-hook copies them
        into fp32 (so none is held as ``step()`` is called); a clip, a norm or a gradient hook
        calls this first and sees O2's fp32 gradients. A no-op otherwise.
        """
        if self.masters is not None and self.masters.remainder:
            self.masters.fp32_grads(optimizer)

    def detach(self) -> None:
        """Undo :meth:`attach` (the model stays in half precision, its masters with it).

        The rounding generators' states are kept: a checkpoint saved after ``fit`` holds them, and
        a later :meth:`attach` continues from them. fp32 accumulation is turned off.
        """
        self.accumulate_in_fp32(False)
        if self.masters is not None:
            self.masters.detach()
        if self._rounders:
            self._rng_states = self._rounding_states()
        for rounder in self._rounders.values():
            rounder.remove()
        self._rounders.clear()

    def _rounding_states(self) -> list[Any]:
        if not self._rounders:
            return self._rng_states
        return [rounder.state_dict() for rounder in self._rounders.values()]

    # -- checkpoints -----------------------------------------------------------------------------

    def rounding_state(self) -> list[dict[str, Any]] | None:
        """The roundings' generator states (one per optimizer), or ``None`` where none rounds stochastically.

        The fp32 masters are not here: they are the model's own ``state_dict()``.
        """
        return self._rounding_states() or None

    def check(self, rounding: object, model_state: object = None) -> None:
        """Raise ``ValueError`` if ``rounding`` or the masters in ``model_state`` would not load.

        ``model_state``: the model's state dict beside it in a checkpoint, whose fp32 master entries
        must fit the masters (``None``: not known here).
        """
        if self.masters is not None and len(self.masters) and isinstance(model_state, dict):
            self.masters.check_fp32_state_dict(model_state)
        if rounding is not None and not (
            isinstance(rounding, list) and all(RoundedUpdates.is_state(state) for state in rounding)
        ):
            raise ValueError(
                f"The checkpoint's {'amp_plugin'!r} entry has a 'rounding' of {type(rounding).__name__} "
                f"{rounding!r:.80}; expected the list RoundedUpdates.state_dict() gives per optimizer. "
                "HINT: the checkpoint is corrupt; resume without ckpt_path or fix the entry."
            )

    def load(self, rounding: object) -> None:
        """Restore the rounding state (the model's own ``load_state_dict`` filled the fp32 masters)."""
        if isinstance(rounding, list):
            self._rng_states = rounding
            for rounder, state in zip(self._rounders.values(), rounding, strict=False):
                rounder.load_state_dict(state)
