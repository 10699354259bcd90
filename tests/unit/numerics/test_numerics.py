"""amp_plugin.numerics: stochastic rounding to bf16/fp16, <IL, FL> fixed point, dtype limits.

Statistical checks use 6-sigma bounds with fixed seeds, so they are deterministic here and
would fail only for a real bias of a fraction of a spacing.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_plugin import numerics
from amp_plugin.numerics import fixed_point, limits, stochastic_round

HALVES = (torch.bfloat16, torch.float16)
N = 200_000


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _neighbours(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The largest ``dtype`` value <= value and the smallest >= value (equal when exact)."""
    near = torch.tensor(value).to(dtype)
    if near.float().item() > value:
        return torch.nextafter(near, near.new_tensor(-math.inf)).item(), near.item()
    if near.float().item() < value:
        return near.item(), torch.nextafter(near, near.new_tensor(math.inf)).item()
    return near.item(), near.item()


# -- stochastic_round ------------------------------------------------------------------------------

_BETWEEN = [
    (torch.bfloat16, 1.0 + 0.3 * 2.0**-7),
    (torch.bfloat16, -3.0 - 0.9 * 2.0**-6),  # negative, in another binade
    (torch.bfloat16, 1234.567),
    (torch.bfloat16, 3.0e-39),  # a float32 (and bf16) subnormal
    (torch.float16, 1.0 + 0.3 * 2.0**-10),
    (torch.float16, -700.123),
    (torch.float16, 0.7 * 2.0**-24),  # below the smallest fp16 subnormal: 0 or 2**-24
    (torch.float16, 5.37 * 2.0**-24),  # between two fp16 subnormals
    (torch.float16, -1.5e-6),  # negative subnormal
]


@pytest.mark.parametrize(("dtype", "value"), _BETWEEN)
def test_stochastic_round_is_unbiased_between_grid_points(dtype: torch.dtype, value: float) -> None:
    x = torch.full((N,), value)
    value = x[0].item()  # as float32 holds it
    lo, hi = _neighbours(value, dtype)
    assert lo < value < hi
    y = stochastic_round(x, dtype, generator=_gen()).double()
    assert set(y.unique().tolist()) == {lo, hi}  # only the two neighbours, both reached
    p = (value - lo) / (hi - lo)
    sigma = (hi - lo) * math.sqrt(p * (1 - p) / N)
    assert abs(y.mean().item() - value) < 6 * sigma
    assert abs(y.mean().item() - value) < 0.01 * (hi - lo)  # and nearest is (much) further off
    nearest = torch.tensor(value).to(dtype).item()
    assert abs(nearest - value) > 0.05 * (hi - lo)


@pytest.mark.parametrize("dtype", HALVES)
def test_every_representable_value_comes_back_bit_for_bit(dtype: torch.dtype) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = every.float()
    y = stochastic_round(x, dtype, generator=_gen())
    nan = every.isnan()
    assert y[nan].isnan().all()
    assert torch.equal(y[~nan].view(torch.int16), every[~nan].view(torch.int16))  # -0.0, ±inf included


@pytest.mark.parametrize("dtype", HALVES)
def test_beyond_the_largest_finite_value_it_rounds_to_nearest(dtype: torch.dtype) -> None:
    top = limits(dtype).max
    spacing = top - torch.nextafter(torch.tensor(top, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    beyond = [top * (1 + 2.0**-20), top + 0.49 * spacing, top + 0.5 * spacing, top + 0.75 * spacing]
    beyond.append(numerics.FP32_MAX)
    x = torch.tensor(beyond + [-v for v in beyond] + [math.inf, -math.inf, math.nan])
    for seed in range(5):
        y = stochastic_round(x, dtype, generator=_gen(seed))
        torch.testing.assert_close(y, x.to(dtype), equal_nan=True, rtol=0, atol=0)
    # just below the top it goes up to max or down to its neighbour, never to inf
    below = torch.full((10_000,), top - 0.5 * spacing)
    y = stochastic_round(below, dtype, generator=_gen()).float()
    assert y.isfinite().all() and set(y.unique().tolist()) == {top - spacing, top}


def test_fp16_overflow_starts_where_round_to_nearest_overflows() -> None:
    x = torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -65519.0, -65520.0])
    y = stochastic_round(x, torch.float16, generator=_gen())
    assert y.tolist() == [65504.0, 65504.0, math.inf, math.inf, -65504.0, -math.inf]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(HALVES),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.integers(0, 2**31),
)
def test_the_result_is_one_of_the_two_neighbours(dtype: torch.dtype, value: float, seed: int) -> None:
    x = torch.tensor([value])
    y = stochastic_round(x, dtype, generator=_gen(seed))
    if abs(value) > limits(dtype).max:
        assert torch.equal(y, x.to(dtype))
        return
    lo, hi = _neighbours(value, dtype)
    assert y.item() in (lo, hi)
    if lo == hi:  # exact: unchanged, the sign of zero included
        assert y.view(torch.int16).item() == x.to(dtype).view(torch.int16).item()


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(HALVES), st.integers(0, 2**31))
def test_rounding_direction_follows_the_fraction_per_element(dtype: torch.dtype, seed: int) -> None:
    # values spread over many binades: each element rounds up roughly as often as its fraction says
    x = torch.randn(64, generator=_gen(seed)) * 10.0 ** torch.randint(-3, 4, (64,), generator=_gen(seed))
    ys = torch.stack([stochastic_round(x, dtype, generator=_gen(seed + k)).double() for k in range(400)])
    lo = torch.tensor([_neighbours(v, dtype)[0] for v in x.tolist()], dtype=torch.float64)
    hi = torch.tensor([_neighbours(v, dtype)[1] for v in x.tolist()], dtype=torch.float64)
    gap = (hi - lo).clamp(min=1e-300)
    p = ((x.double() - lo) / gap).where(hi > lo, 0.0)
    up = ((ys - lo) / gap).where(hi > lo, 0.0).mean(0)
    # 6 standard deviations, plus 6 of the 400 draws: where p is tiny (a fraction of 2**-12, say) the
    # count of ups is a rare-event count, and 2 ups in 400 (p = 0.5%) broke the normal-only bound.
    assert ((up - p).abs() <= 6 * (p * (1 - p) / 400).sqrt() + 6 / 400).all()


@pytest.mark.parametrize("dtype", HALVES)
def test_the_same_generator_state_gives_the_same_result(dtype: torch.dtype) -> None:
    x = torch.full((10_000,), 1.0 + 0.5 * limits(dtype).eps)
    a = stochastic_round(x, dtype, generator=_gen(7))
    assert torch.equal(a, stochastic_round(x, dtype, generator=_gen(7)))
    assert not torch.equal(a, stochastic_round(x, dtype, generator=_gen(8)))
    g = _gen(7)
    first = stochastic_round(x, dtype, generator=g)
    assert not torch.equal(first, stochastic_round(x, dtype, generator=g))  # the generator advanced
    torch.manual_seed(3)
    b = stochastic_round(x, dtype)  # torch's default generator
    torch.manual_seed(3)
    assert torch.equal(b, stochastic_round(x, dtype))


@pytest.mark.parametrize("dtype", HALVES)
def test_result_dtype_shape_layout_and_grad(dtype: torch.dtype) -> None:
    x = (torch.randn(4, 6) * 3).requires_grad_()
    t = x.t()  # not contiguous
    y = stochastic_round(t, dtype, generator=_gen(1))
    assert y.dtype == dtype and y.shape == (6, 4) and y.is_contiguous() and not y.requires_grad
    assert torch.equal(y, stochastic_round(t.detach().contiguous(), dtype, generator=_gen(1)))
    assert x.grad is None and x.dtype == torch.float32  # input untouched
    scalar = stochastic_round(torch.tensor(2.5), dtype, generator=_gen())
    assert scalar.shape == () and scalar.item() == 2.5
    empty = stochastic_round(torch.empty(0, 3), dtype)
    assert empty.shape == (0, 3) and empty.dtype == dtype


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([1.0], torch.float16), TypeError, r"stochastic_round\(x=list\).*HINT: pass a tensor"),
        ((torch.ones(2, dtype=torch.float16), torch.float16), TypeError, r"HINT: x is already torch.float16"),
        ((torch.ones(2, dtype=torch.float64), torch.float16), TypeError, r"float32 tensor.*HINT: .*float"),
        ((torch.ones(2, dtype=torch.int32), torch.bfloat16), TypeError, r"torch.int32.*HINT"),
        ((torch.ones(2), torch.float32), ValueError, r"dtype=torch.float32.*HINT: a float32 x needs no"),
        ((torch.ones(2), torch.int8), ValueError, r"dtype=torch.int8.*HINT: pass torch.bfloat16 or"),
        ((torch.ones(2), "bfloat16"), ValueError, r"dtype='bfloat16'.*HINT"),
    ],
)
def test_stochastic_round_refuses_bad_arguments(args: tuple, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        stochastic_round(*args)


def test_stochastic_round_refuses_a_bad_generator() -> None:
    with pytest.raises(TypeError, match=r"generator=0\).*a torch.Generator or None.*HINT: pass"):
        stochastic_round(torch.ones(2), torch.float16, generator=0)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_a_generator_on_another_device_is_refused_and_cuda_matches_the_cpu_rule() -> None:
    x = torch.full((N,), 1.0 + 0.3 * 2.0**-7, device="cuda")
    with pytest.raises(ValueError, match=r"generator on cpu, x on cuda.*HINT: create it with"):
        stochastic_round(x, torch.bfloat16, generator=_gen())
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in HALVES:
        y = stochastic_round(x, dtype, generator=g).double()
        lo, hi = _neighbours(x[0].item(), dtype)
        assert set(y.unique().tolist()) == {lo, hi}
        assert abs(y.mean().item() - x[0].item()) < 0.01 * (hi - lo)
    special = torch.tensor([65520.0, math.nan, -math.inf], device="cuda")
    y = stochastic_round(special, torch.float16, g)
    torch.testing.assert_close(y, special.half(), equal_nan=True, rtol=0, atol=0)


# -- fixed_point -------------------------------------------------------------------------------------

FLS = (14, 10, 8)


def _nearest_reference(value: float, il: int, fl: int) -> float:
    """Gupta et al.'s round-to-nearest (ties down) then saturation, in exact rationals."""
    units = Fraction(value) * 2**fl
    low = math.floor(units)
    q = low if units - low <= Fraction(1, 2) else low + 1
    q = min(max(q, -(2 ** (il + fl - 1))), 2 ** (il + fl - 1) - 1)
    return float(Fraction(q, 2**fl))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, 13),
    st.lists(st.floats(-5000, 5000, width=32), min_size=1, max_size=20),
)
def test_round_to_nearest_is_exact_and_saturates(il: int, fl: int, values: list[float]) -> None:
    x = torch.tensor(values)
    y = fixed_point(x, il, fl)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert y.tolist() == [_nearest_reference(v, il, fl) for v in x.tolist()]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([(16 - fl, fl) for fl in FLS] + [(1, 0), (2, 23), (30, 20)]),
    st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=20),
    st.integers(0, 2**31),
)
def test_stochastic_results_lie_on_the_grid_next_to_x(
    ilfl: tuple[int, int], values: list[float], seed: int
) -> None:
    il, fl = ilfl
    dtype = torch.float64 if il + fl > 25 else torch.float32
    x = torch.tensor(values, dtype=dtype)
    y = fixed_point(x, il, fl, "stochastic", generator=_gen(seed))
    eps, top = 2.0**-fl, 2.0 ** (il - 1)
    units = y.double() / eps
    assert torch.equal(units, units.round())  # on the grid
    assert ((y >= -top) & (y <= top - eps)).all()  # inside the range
    inside = x.clamp(-top, top - eps)
    assert ((y - inside).abs() < eps).all()  # one of the two grid values around x


@pytest.mark.parametrize("fl", FLS)
def test_saturation_and_specials(fl: int) -> None:
    il = 16 - fl
    top, eps = 2.0 ** (il - 1), 2.0**-fl
    x = torch.tensor([1e30, -1e30, math.inf, -math.inf, top, -top, top - eps / 3, -top - eps, math.nan])
    for rounding in ("nearest", "stochastic"):
        y = fixed_point(x, il, fl, rounding)  # type: ignore[arg-type]
        assert y[:-1].tolist() == [top - eps, -top, top - eps, -top, top - eps, -top, top - eps, -top]
        assert y[-1].isnan()  # NaN is not hidden


@pytest.mark.parametrize("fl", FLS)
def test_stochastic_fixed_point_is_unbiased_inside_the_range(fl: int) -> None:
    il, eps = 16 - fl, 2.0**-fl
    for value in (0.3 * eps, -5.3 * eps, 1.0 + 0.71 * eps, -(2.0 ** (il - 2)) - 0.5 * eps):
        x = torch.full((N,), value, dtype=torch.float64)
        y = fixed_point(x, il, fl, "stochastic", generator=_gen())
        lo = math.floor(value / eps) * eps
        assert set(y.unique().tolist()) == {lo, lo + eps}
        p = (value - lo) / eps
        assert abs(y.mean().item() - value) < 6 * eps * math.sqrt(p * (1 - p) / N)
        assert fixed_point(x[:1], il, fl).item() != pytest.approx(value, abs=0.05 * eps)


def test_fixed_point_is_reproducible_and_keeps_layout() -> None:
    x = torch.rand(5, 7, requires_grad=True).t()
    a = fixed_point(x, 2, 10, "stochastic", _gen(3))
    assert torch.equal(a, fixed_point(x, 2, 10, "stochastic", _gen(3)))
    assert not torch.equal(a, fixed_point(x, 2, 10, "stochastic", _gen(4)))
    assert a.shape == (7, 5) and not a.requires_grad and a.dtype == torch.float32
    assert fixed_point(torch.empty(0), 4, 4).shape == (0,)
    assert torch.equal(fixed_point(x, 2, 10), fixed_point(x, 2, 10))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"il": 0, "fl": 4}, ValueError, r"fixed_point\(il=0\).*HINT"),
        ({"il": 4, "fl": -1}, ValueError, r"fixed_point\(fl=-1\).*HINT"),
        ({"il": 4.0, "fl": 4}, TypeError, r"fixed_point\(il=4.0\).*HINT"),
        ({"il": True, "fl": 4}, TypeError, r"il=True.*HINT"),
        ({"il": 4, "fl": 4, "rounding": "up"}, ValueError, r"rounding='up'.*HINT: pass 'nearest' or"),
        ({"il": 10, "fl": 16}, ValueError, r"il=10, fl=16.*IL \+ FL <= 25.*HINT: use x.double\(\)"),
        ({"il": 4, "fl": 4, "generator": _gen()}, ValueError, r"'nearest'.*HINT: drop the generator"),
        ({"il": 4, "fl": 4, "rounding": "stochastic", "generator": 1}, TypeError, r"generator=1.*HINT"),
        ({"x": torch.ones(2, dtype=torch.float16), "il": 4, "fl": 4}, TypeError, r"float16.*HINT: .*float"),
        ({"x": torch.ones(2, dtype=torch.int64), "il": 4, "fl": 4}, TypeError, r"torch.int64.*HINT"),
        ({"x": torch.ones(2, dtype=torch.float64), "il": 30, "fl": 30}, ValueError, r"IL \+ FL <= 54.*HINT"),
    ],
)
def test_fixed_point_refuses_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    kwargs = {"x": torch.ones(2), **kwargs}
    with pytest.raises(error, match=match):
        fixed_point(**kwargs)


# -- limits -------------------------------------------------------------------------------------------

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", FLOATS)
def test_limits_agree_with_finfo_and_the_module_constants(dtype: torch.dtype) -> None:
    lim, fi = limits(dtype), torch.finfo(dtype)
    assert (lim.dtype, lim.max, lim.smallest_normal, lim.eps) == (dtype, fi.max, fi.smallest_normal, fi.eps)
    zero = torch.zeros((), dtype=dtype)
    assert lim.smallest_subnormal == torch.nextafter(zero, zero + 1).item()
    assert lim.smallest_subnormal == lim.smallest_normal * lim.eps
    prefix = {torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32"}[dtype]
    consts = [getattr(numerics, f"{prefix}_{n}") for n in ("MAX", "MIN_NORMAL", "MIN_SUBNORMAL", "EPS")]
    assert consts == [lim.max, lim.smallest_normal, lim.smallest_subnormal, lim.eps]
    assert limits(dtype) is lim  # one shared instance


@pytest.mark.parametrize("dtype", FLOATS)
def test_safe_mask_value_survives_stacked_masks_and_softmax(dtype: torch.dtype) -> None:
    lim = limits(dtype)
    mask = torch.tensor(lim.safe_mask_value, dtype=dtype)
    assert torch.tensor(lim.safe_mask_value, dtype=dtype).item() == lim.safe_mask_value  # exact in dtype
    scores = (torch.randn(8, 16) * 30).to(dtype)
    scores[1, 12] = -lim.max / 2  # a very negative score under both masks
    pad = torch.zeros(8, 16, dtype=dtype)
    pad[:, 10:] = mask  # padding
    causal = torch.triu(torch.full((8, 16), lim.safe_mask_value, dtype=dtype), 1)
    pad[7] = mask  # a row masked completely
    logits = scores + pad + causal  # two masks on top of each other
    assert logits.isfinite().all()
    probs = torch.softmax(logits.float() if dtype == torch.float16 else logits, -1).to(dtype)
    probs16 = torch.softmax(logits, -1)
    for p in (probs, probs16):
        assert p.isfinite().all()
        masked = (pad[:7] != 0) | (causal[:7] != 0)
        assert (p[:7][masked] == 0).all()  # masked entries get exactly nothing
        torch.testing.assert_close(p.float().sum(-1), torch.ones(8), atol=1e-2, rtol=0)
    # what it replaces: finfo.min overflows to -inf when two masks stack, and a row masked
    # completely by -inf is NaN after softmax
    low = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    assert (low + low).isinf()
    assert torch.softmax(torch.full((4,), -math.inf, dtype=dtype), -1).isnan().all()


def test_safe_eps_is_a_normal_number_that_dtype_keeps() -> None:
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # why fp16 needs another eps
    assert limits(torch.float16).safe_eps == 2.0**-14
    for dtype in FLOATS:
        eps = limits(dtype).safe_eps
        held = torch.tensor(eps, dtype=dtype)
        assert held.item() == eps and eps >= limits(dtype).smallest_normal
        assert (1.0 / (torch.zeros((), dtype=dtype) + held)).isfinite()  # a safe denominator
    for dtype in (torch.bfloat16, torch.float32):
        assert limits(dtype).safe_eps == pytest.approx(1e-8, rel=limits(dtype).eps)


@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        ("float16", r"limits\(dtype='float16'\).*HINT: pass torch.float16\."),
        (torch.float64, r"dtype=torch.float64.*HINT: pass torch.float16, torch.bfloat16 or torch.float32"),
        (torch.int32, r"dtype=torch.int32.*HINT"),
        ("nonsense", r"dtype='nonsense'.*HINT: pass torch.float16, torch.bfloat16"),
    ],
)
def test_limits_refuses_other_dtypes(dtype: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        limits(dtype)  # type: ignore[arg-type]
