"""How an optimizer step is written into half-precision weights: nearest, stochastic or Kahan.

With weights held in bf16 or fp16 and no fp32 copy ("bf16-true", Apex's O3), an update
smaller than half the spacing between neighbouring half values is rounded away, so a long
run of small updates stalls. :class:`RoundedUpdates` wraps an existing optimizer (any
``torch.optim`` optimizer that is not ``fused``) with step hooks:

- ``"nearest"``: no hooks; the optimizer writes in half precision itself (round to nearest).
- ``"stochastic"``: the step runs on fp32 copies that stand in for the half parameters in the
  param groups (grads and optimizer state stay half), and the result is written back with
  :func:`~amp_plugin.numerics.stochastic_round`: unbiased, so small updates survive in
  expectation. Persistent memory is that of pure half training; the fp32 copies exist only
  during the step. The parameters themselves keep their dtype throughout, so hooks on them and
  on their gradient accumulators (DDP's all-reduce) stay in place.
- ``"kahan"``: the same, but the rounding error of each write is kept in a half-precision
  compensation buffer (``optimizer.state[p]["amp_plugin.kahan"]``, so it is checkpointed with
  the optimizer) and added back before the next step: deterministic, 2 more bytes per parameter.

Optimizer state created during a step (in fp32, because the step saw fp32 copies) is stored in
the parameter's half dtype afterwards, as it would be in pure half training; state the
optimizer already held keeps its dtype. A skipped step (a loss scaler's overflow) never calls
the optimizer, so nothing changes.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from amp_plugin._optim import unwrap_optimizer
from amp_plugin._validation import check_choice, check_int, fail
from amp_plugin.numerics import stochastic_round

__all__ = ["RoundedUpdates"]

Rounding = Literal["nearest", "stochastic", "kahan"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "kahan")
KAHAN_KEY = "amp_plugin.kahan"
_HALF = (torch.float16, torch.bfloat16)


class RoundedUpdates:
    """Step hooks on ``optimizer`` that write updates into its half parameters with ``rounding``.

    Args:
        optimizer: a ``torch.optim`` optimizer (Lightning's wrapper is unwrapped) whose
            parameters are (partly) fp16/bf16; fp32 parameters are left to the optimizer.
        rounding: ``"nearest"``, ``"stochastic"`` or ``"kahan"`` (see the module docs).
        seed: seeds the stochastic rounding's own generator (one per device), so every
            data-parallel rank draws the same numbers and replicas stay identical. Its state is
            in :meth:`state_dict` for bit-exact resumes.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        >>> opt = torch.optim.SGD([w], lr=1e-4)
        >>> updates = RoundedUpdates(opt, "stochastic", seed=0)
        >>> for _ in range(100):
        ...     w.grad = torch.ones_like(w)
        ...     opt.step()  # each update is 1e-4, far below bf16's spacing near 1 (2**-7)
        >>> round(w.float().mean().item(), 2)  # fp32 would give 0.99; "nearest" stays at 1.0
        0.99
        >>> updates.remove()
    """

    def __init__(self, optimizer: Any, rounding: Rounding = "stochastic", seed: int = 0) -> None:
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, Optimizer):
            fail(
                "RoundedUpdates",
                passed=f"optimizer={optimizer!r:.80}",
                allowed="a torch.optim.Optimizer",
                hint="pass the optimizer built on the half-precision parameters.",
                error=TypeError,
            )
        self.rounding: Rounding = check_choice("RoundedUpdates", "rounding", rounding, ROUNDINGS)
        self.seed = check_int("RoundedUpdates", "seed", seed, low=0)
        if self.rounding != "nearest" and any(g.get("fused") for g in opt.param_groups):
            fail(
                "RoundedUpdates",
                passed=f"rounding={rounding!r} with {type(opt).__name__}(fused=True)",
                why="a fused step needs one dtype for parameters, gradients and state",
                allowed="an optimizer that is not fused",
                hint=(f"build {type(opt).__name__}(..., foreach=True) instead, or use rounding='nearest'."),
            )
        self.optimizer = opt
        self._generators: dict[torch.device, torch.Generator] = {}
        # (parameter, its fp32 stand-in, the param list holding it, its index there, its state keys before)
        self._pending: list[tuple[Tensor, Tensor, list[Tensor], int, set[str]]] = []
        self._handles: list[RemovableHandle] = []
        if self.rounding != "nearest":
            self._handles = [
                opt.register_step_pre_hook(lambda o, args, kwargs: self._widen()),
                opt.register_step_post_hook(lambda o, args, kwargs: self._write_back()),
            ]

    def remove(self) -> None:
        """Remove the hooks; the optimizer then writes in half precision itself."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    @torch.no_grad()
    def _widen(self) -> None:
        """Before the step: every half parameter with a gradient is stood in for by an fp32 copy.

        The stand-in takes the parameter's place in its param group and its optimizer state for
        the step. The parameter itself is left alone: changing its ``.data`` to another dtype
        would make torch build it a new gradient accumulator, dropping the hooks DDP all-reduces
        from.
        """
        self._pending.clear()
        opt_state = self.optimizer.state
        for group in self.optimizer.param_groups:
            params = group["params"]
            for index, p in enumerate(params):
                if p.grad is None or p.dtype not in _HALF:
                    continue
                state = opt_state.pop(p, {})
                wide = p.detach().float()
                if self.rounding == "kahan" and KAHAN_KEY in state:
                    wide.add_(state[KAHAN_KEY])
                if state:  # the half gradient as it is: the state it meets is half already
                    wide.grad_dtype = None
                    wide.grad = p.grad
                else:  # the optimizer makes its state like the gradient: fp32 this once, then narrowed
                    wide.grad = p.grad.float()
                self._pending.append((p, wide, params, index, set(state)))
                params[index] = wide
                opt_state[wide] = state

    @torch.no_grad()
    def _write_back(self) -> None:
        """After the step: round the fp32 results into the half parameters; narrow new state."""
        opt_state = self.optimizer.state
        for p, wide, params, index, keys_before in self._pending:
            half = p.data
            state = opt_state.pop(wide)
            if self.rounding == "stochastic":
                half.copy_(stochastic_round(wide, half.dtype, self._generator(wide.device)))
            else:
                half.copy_(wide)  # round to nearest; the error goes into the compensation
                comp = state.get(KAHAN_KEY)
                if comp is None:
                    comp = state[KAHAN_KEY] = torch.empty_like(half)
                comp.copy_(wide.sub_(half))
            params[index] = p
            opt_state[p] = state
            for key, value in state.items():
                if (
                    key not in keys_before
                    and isinstance(value, Tensor)
                    and value.dtype == torch.float32
                    and value.dim() > 0
                ):
                    state[key] = value.to(half.dtype)
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The rounding, the seed and each generator's state (for bit-exact resumes)."""
        return {
            "rounding": self.rounding,
            "seed": self.seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    @staticmethod
    def is_state(state: object) -> bool:
        """Whether ``state`` has the shape of :meth:`state_dict`'s result (generator states by device)."""
        gens = state.get("generators") if isinstance(state, dict) else None
        return isinstance(gens, dict) and all(
            isinstance(k, str) and isinstance(v, Tensor) and v.dtype == torch.uint8 for k, v in gens.items()
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s generator states (checked before anything changes)."""
        if not self.is_state(state):
            fail(
                "RoundedUpdates.load_state_dict",
                passed=f"state={state!r:.80}",
                why="it is not the dict RoundedUpdates.state_dict() returns",
                allowed="a dict from RoundedUpdates.state_dict()",
                hint="load the state this class saved.",
            )
        for device, gen_state in state["generators"].items():
            self._generator(torch.device(device)).set_state(gen_state)
