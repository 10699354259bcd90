"""Property: for any call sequence, LossScaler takes exactly GradScaler's steps, bit for bit.

Hypothesis draws the scaler's arguments, one or two optimizers and a list of iterations
(micro-batches, inf/NaN injected where, explicit ``unscale_``, torch's clipping recipe, a
checkpoint round trip between iterations). Both scalers run the same calls in lockstep on
twin models; after every iteration the scales, the skip decisions, every parameter and
every optimizer-state tensor must be equal bit for bit.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from tests._scaler_twins import (
    OPTIMIZERS,
    POISONS,
    assert_same_snapshots,
    grad_scaler,
    loss_scaler,
    mlp,
    snapshot,
    step,
)

SMALLEST_NORMAL = 2.0**-126  # below it LossScaler floors its scale on purpose; stop comparing there
N_PARAMS = 6  # mlp(): three linear layers

_poison = st.tuples(
    st.integers(0, 2),  # after which micro-batch (clamped to the last one)
    st.integers(0, N_PARAMS - 1),  # which parameter
    st.floats(0.0, 0.999),  # where in it
    st.sampled_from(sorted(POISONS)),
)
_iteration = st.fixed_dictionaries(
    {
        "micro": st.integers(1, 3),
        "poisons": st.lists(_poison, max_size=2) | st.just([]),
        "unscale": st.tuples(st.booleans(), st.booleans()),
        "clip": st.tuples(*[st.sampled_from([None, None, 0.05, 1.0])] * 2),
        "reload": st.sampled_from([None, None, None, "ours", "torch", "pickle"]),
    }
)
_config = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from([0.25, 1.0, 3.0, 2.0**7, 1000.0, 2.0**20]),
        "growth_factor": st.sampled_from([1.5, 2.0, 3.0, 1.0001]),
        "backoff_factor": st.sampled_from([0.25, 0.5, 0.7, 0.9999]),
        "growth_interval": st.integers(1, 4),
    }
)
_optimizers = st.lists(st.sampled_from(["sgd-momentum", "adam", "adamw-fused"]), min_size=1, max_size=2)


class _Arm:
    """One side: a model, its optimizers and a scaler."""

    def __init__(self, scaler: Any, optimizers: list[str]) -> None:
        self.scaler = scaler
        self.model = mlp(width=6)
        self.params = list(self.model.parameters())
        # with two optimizers the first owns the first layer, the second the rest
        cut = 2 if len(optimizers) == 2 else N_PARAMS
        groups = [self.params[:cut], self.params[cut:]][: len(optimizers)]
        self.opts = [OPTIMIZERS[name](group) for name, group in zip(optimizers, groups, strict=True)]

    def iterate(self, it: dict[str, Any], x: torch.Tensor) -> tuple[bool, ...]:
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        for m in range(it["micro"]):
            self.scaler.scale(self.model(x[m]).pow(2).mean()).backward()
            for micro, index, where, value in it["poisons"]:
                if min(micro, it["micro"] - 1) == m:
                    grad = self.params[index].grad
                    assert grad is not None
                    with torch.no_grad():
                        grad.view(-1)[int(where * grad.numel())] = POISONS[value]
        for k, opt in enumerate(self.opts):
            if it["unscale"][k]:
                self.scaler.unscale_(opt)
            if it["clip"][k] is not None:
                if not it["unscale"][k]:
                    self.scaler.unscale_(opt)
                params = [p for g in opt.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, it["clip"][k])
        skipped = tuple(step(self.scaler, opt) for opt in self.opts)
        self.scaler.update()
        return skipped


def _reload(ours: Any, theirs: Any, how: str | None) -> Any:
    if how is None:
        return ours
    if how == "pickle":
        return pickle.loads(pickle.dumps(ours))
    fresh = loss_scaler()
    fresh.load_state_dict((ours if how == "ours" else theirs).state_dict())
    return fresh


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=_config,
    optimizers=_optimizers,
    iterations=st.lists(_iteration, min_size=1, max_size=8),
    seed=st.integers(0, 3),
)
def test_loss_scaler_takes_grad_scalers_steps(
    config: dict[str, Any], optimizers: list[str], iterations: list[dict[str, Any]], seed: int
) -> None:
    theirs, ours = _Arm(grad_scaler(**config), optimizers), _Arm(loss_scaler(**config), optimizers)
    x = torch.randn(len(iterations), 3, 4, 5, generator=torch.Generator().manual_seed(seed))
    for i, it in enumerate(iterations):
        ours.scaler = _reload(ours.scaler, theirs.scaler, it["reload"])
        before = theirs.scaler.get_scale()
        skipped_theirs = theirs.iterate(it, x[i])
        skipped_ours = ours.iterate(it, x[i])
        after = theirs.scaler.get_scale()
        if after < SMALLEST_NORMAL:
            break
        event("scale grew" if after > before else "scale backed off" if after < before else "scale held")
        event(f"skipped {sum(skipped_theirs)} of {len(skipped_theirs)} optimizers")
        assert ours.scaler.get_scale() == theirs.scaler.get_scale(), f"scale after iteration {i}"
        assert skipped_ours == skipped_theirs, f"skipped steps in iteration {i}"
        for k, (a, b) in enumerate(zip(theirs.opts, ours.opts, strict=True)):
            assert_same_snapshots(snapshot(a), snapshot(b), f"iteration {i}, optimizer {k}")


def test_twin_models_start_equal() -> None:
    """The arms differ only in their scaler: same initial parameters, same split into optimizers."""
    a, b = _Arm(grad_scaler(), ["adam", "adamw-fused"]), _Arm(loss_scaler(), ["adam", "adamw-fused"])
    assert [len(o.param_groups[0]["params"]) for o in a.opts] == [2, 4]
    for opt_a, opt_b in zip(a.opts, b.opts, strict=True):
        assert_same_snapshots(snapshot(opt_a), snapshot(opt_b))
    assert isinstance(a.model, nn.Module)
