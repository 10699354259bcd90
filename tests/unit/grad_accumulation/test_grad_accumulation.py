"""Fp32GradAccumulation: micro-batch gradients of half parameters add up in fp32 (fp64 oracle)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from amp_plugin._half_weights import HalfWeights
from amp_plugin.grad_accumulation import Fp32GradAccumulation

MICRO = 8


def _rows(device: str) -> Tensor:
    """8 gradients: the first in [1, 2), the other 7 in [2**-10, 2**-9) (2**10 apart), bf16 values."""
    g = torch.Generator().manual_seed(5)
    rows = 1 + torch.rand(MICRO, 32, generator=g)
    rows[1:] *= 2.0**-10
    return rows.bfloat16().float().to(device)


def _accumulate(param: nn.Parameter, rows: Tensor) -> None:
    for row in rows:
        (param * row.to(param.dtype)).float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_grad_gets_the_fp32_sum_rounded_once(device: str, dtype: torch.dtype) -> None:
    rows = _rows(device)
    param = nn.Parameter(torch.ones(32, dtype=dtype, device=device))
    acc = Fp32GradAccumulation([param])
    _accumulate(param, rows)
    assert param.grad is None and acc.pending() == 1
    acc.flush_([(param, param)])
    reference = rows.double().sum(0)
    assert param.grad is not None and param.grad.dtype == dtype
    assert torch.equal(param.grad, reference.to(dtype))
    assert acc.pending() == 0  # the fp32 sum is freed at the step
    # Without it, torch adds up in the half .grad and the small micro-batches are lost.
    acc.remove()
    param.grad = None
    _accumulate(param, rows)
    assert not torch.equal(param.grad, reference.to(dtype))


def test_an_fp32_target_takes_the_sum_itself(device: str) -> None:
    rows = _rows(device)
    param = nn.Parameter(torch.ones(32, dtype=torch.bfloat16, device=device))
    master = nn.Parameter(torch.ones(32, device=device))
    acc = Fp32GradAccumulation([param])
    _accumulate(param, rows)
    acc.flush_([(param, master)])
    assert param.grad is None and master.grad is not None and master.grad.dtype == torch.float32
    reference = rows.double().sum(0)
    assert torch.allclose(master.grad.double(), reference, rtol=MICRO * 2.0**-24, atol=0)
    acc.remove()


def test_only_trainable_half_parameters_are_hooked_and_remove_restores_torch() -> None:
    half = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    fp32 = nn.Parameter(torch.ones(2))
    frozen = nn.Parameter(torch.ones(2, dtype=torch.bfloat16), requires_grad=False)
    acc = Fp32GradAccumulation([half, fp32, frozen, half])
    assert len(acc) == 1
    (half.float().sum() + fp32.sum()).backward()
    assert half.grad is None and fp32.grad is not None
    acc.remove()
    assert acc.pending() == 0
    half.float().sum().backward()
    assert half.grad is not None


def test_half_weights_flush_only_the_stepped_optimizers_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    weights = HalfWeights(master_weights=True)
    weights.convert(model, torch.bfloat16)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    weights.attach([first, second])
    weights.accumulate_in_fp32(True)
    for _ in range(2):
        model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    weights.before_step(first)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in first.param_groups[0]["params"])
    assert all(p.grad is None for p in second.param_groups[0]["params"])
    weights.before_step(second)
    assert all(p.grad is not None for p in second.param_groups[0]["params"])
    weights.detach()  # turns accumulation off: gradients add up in .grad again
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert model[0].weight.grad is not None


def test_a_backward_that_failed_half_way_leaves_the_accumulation_working() -> None:
    """After a backward that raised half-way (and the zero_grad that follows), the next micro-batches
    add up in fp32 as before."""
    w1, w2 = (nn.Parameter(torch.ones(2, dtype=torch.bfloat16)) for _ in range(2))
    acc = Fp32GradAccumulation([w1, w2])
    x = torch.ones(2, dtype=torch.bfloat16)

    def fail(grad: Tensor) -> Tensor:
        raise RuntimeError("a hook that fails")

    broken = (w2 * x).sum()
    broken.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook that fails"):
        ((w1 * x).sum() + broken).backward()
    w1.grad = w2.grad = None  # what zero_grad does after a failed step
    acc.clear()
    for _ in range(3):
        ((w1 * x).sum() + (w2 * 2 * x).sum()).backward()
    assert w1.grad is None and w2.grad is None and acc.pending() == 2
    acc.flush_([(w1, w1), (w2, w2)])
    assert w1.grad.tolist() == [3.0, 3.0] and w2.grad.tolist() == [6.0, 6.0]
    acc.remove()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_with_create_graph_keeps_the_sums_out_of_autograd() -> None:
    w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    acc = Fp32GradAccumulation([w])
    for _ in range(2):
        (w * w).sum().backward(create_graph=True)
    acc.flush_([(w, w)])
    assert w.grad is not None and not w.grad.requires_grad and w.grad.tolist() == [4.0, 4.0]
    acc.remove()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (3, r"Fp32GradAccumulation\(params=int\).*HINT: pass model.parameters\(\)"),
        (nn.Linear(2, 2), r"params=Linear.*a module, not its parameters.*HINT: pass model.parameters\(\)"),
        ([nn.Parameter(torch.ones(1, dtype=torch.bfloat16)), "w"], r"params=\[\.\.\., str\].*HINT"),
    ],
)
def test_what_is_not_parameters_is_refused_before_anything_is_hooked(params: object, match: str) -> None:
    first = params[0] if isinstance(params, list) else None
    with pytest.raises(TypeError, match=match):
        Fp32GradAccumulation(params)  # type: ignore[arg-type]
    if isinstance(first, nn.Parameter):  # nothing half-applied: its gradient reaches .grad as without us
        (first * 2.0).sum().backward()
        assert first.grad is not None and first.grad.item() == 2.0
