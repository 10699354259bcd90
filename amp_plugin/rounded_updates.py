"""How an optimizer step is written into half-precision weights: nearest, stochastic or Kahan.

With weights held in bf16 or fp16 and no fp32 copy ("bf16-true", Apex's O3), an update
smaller than half the spacing between neighbouring half values is rounded away, so a long
run of small updates stalls. :class:`RoundedUpdates` wraps an existing optimizer (any
``torch.optim`` optimizer that is not ``fused``) with step hooks:

- ``"nearest"``: no hooks; the optimizer writes in half precision itself (round to nearest).
- ``"stochastic"``: the step runs on fp32 views of the half parameters (grads and optimizer
  state stay half), and the result is written back with :func:`~amp_plugin.numerics.stochastic_round`:
  unbiased, so small updates survive in expectation. Persistent memory is that of pure half
  training; the fp32 views exist only during the step.
- ``"kahan"``: the same, but the rounding error of each write is kept in a half-precision
  compensation buffer (``optimizer.state[p]["amp_plugin.kahan"]``, so it is checkpointed with
  the optimizer) and added back before the next step: deterministic, 2 more bytes per parameter.

Optimizer state created during a step (in fp32, because the step saw fp32 views) is stored in
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

from amp_plugin._validation import check_choice, check_int, fail
from amp_plugin.numerics import stochastic_round
from amp_plugin.optim import unwrap_optimizer

__all__ = ["KAHAN_KEY", "ROUNDINGS", "RoundedUpdates"]

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
                allowed=(
                    "an optimizer that is not fused (a fused step needs one dtype for parameters, "
                    "gradients and state)"
                ),
                hint=(f"build {type(opt).__name__}(..., foreach=True) instead, or use rounding='nearest'."),
            )
        self.optimizer = opt
        self._generators: dict[torch.device, torch.Generator] = {}
        # (parameter, its half storage, its half gradient, the state keys it had before the step)
        self._pending: list[tuple[Tensor, Tensor, Tensor, set[str]]] = []
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
        """Before the step: every half parameter with a gradient gets fp32 ``.data``."""
        self._pending.clear()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype not in _HALF:
                    continue
                state = self.optimizer.state[p]
                half, grad = p.data, p.grad
                wide = half.float()
                if self.rounding == "kahan" and KAHAN_KEY in state:
                    wide.add_(state[KAHAN_KEY])
                self._pending.append((p, half, grad, set(state)))
                p.data = wide
                if not state:  # the optimizer makes its state like the gradient: fp32 this once
                    p.grad = grad.float()

    @torch.no_grad()
    def _write_back(self) -> None:
        """After the step: round the fp32 results into the half storage; narrow new state."""
        for p, half, grad, keys_before in self._pending:
            wide = p.data
            state = self.optimizer.state[p]
            if self.rounding == "stochastic":
                half.copy_(stochastic_round(wide, half.dtype, self._generator(wide.device)))
            else:
                half.copy_(wide)  # round to nearest; the error goes into the compensation
                comp = state.get(KAHAN_KEY)
                if comp is None:
                    comp = state[KAHAN_KEY] = torch.empty_like(half)
                comp.copy_(wide.sub_(half))
            p.data = half
            p.grad = grad
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
                allowed="a dict from RoundedUpdates.state_dict()",
                hint="load the state this class saved.",
            )
        for device, gen_state in state["generators"].items():
            self._generator(torch.device(device)).set_state(gen_state)
