"""Rounding for low precision: stochastic rounding to bf16/fp16, ``<IL, FL>`` fixed point, dtype limits.

* :func:`stochastic_round` rounds float32 to bfloat16 or float16 so that the result is right on
  average: an update smaller than the half dtype's spacing survives in expectation instead of
  vanishing, which is what lets weights live in bf16 without an fp32 copy.
* :func:`fixed_point` puts values on the ``<IL, FL>`` grid of Gupta et al. 2015 ("Deep Learning
  with Limited Numerical Precision"), with the paper's round-to-nearest and stochastic modes.
* :func:`limits` and the ``FP16_*``/``BF16_*``/``FP32_*`` constants: the largest finite value,
  the smallest normal and subnormal, the spacing at 1.0, a mask value and a denominator
  epsilon that are safe in each dtype.

Plain torch; nothing here imports Lightning or initialises a device.

Example:
    >>> x = torch.full((100_000,), 1.0 + 2.0**-10)  # a quarter of bf16's spacing above 1.0
    >>> x.to(torch.bfloat16).float().mean().item()  # round-to-nearest loses it every time
    1.0
    >>> y = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(0))
    >>> round(y.float().mean().item(), 4)  # kept on average
    1.001
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from amp_plugin._validation import check_choice, check_int, fail

__all__ = ["Limits", "fixed_point", "limits", "stochastic_round"]

FP16_MAX = 65504.0  # largest finite float16; x.to(float16) is inf from 65520 on
FP16_MIN_NORMAL = 2.0**-14  # below it float16 keeps fewer than 11 significant bits
FP16_MIN_SUBNORMAL = 2.0**-24  # anything below half of it rounds to 0
FP16_EPS = 2.0**-10  # spacing at 1.0
BF16_MAX = float.fromhex("0x1.fep127")  # 3.3895e38
BF16_MIN_NORMAL = 2.0**-126  # float32's exponent range, with 8 significant bits
BF16_MIN_SUBNORMAL = 2.0**-133
BF16_EPS = 2.0**-7
FP32_MAX = float.fromhex("0x1.fffffep127")  # 3.4028e38
FP32_MIN_NORMAL = 2.0**-126
FP32_MIN_SUBNORMAL = 2.0**-149
FP32_EPS = 2.0**-23

Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class Limits:
    """What a floating-point dtype can hold, and two values that are safe to compute with in it.

    ``max``, ``smallest_normal`` and ``eps`` (the spacing at 1.0) are ``torch.finfo``'s;
    ``smallest_subnormal`` is the smallest positive value (``smallest_normal * eps``).

    ``safe_mask_value`` is ``-max / 4``, for additive attention masks: two masks on top of
    each other (padding and causal) plus a score down to ``-max / 2`` still add up to a
    finite value, whereas ``torch.finfo(dtype).min`` overflows to ``-inf`` when added twice
    and gives NaN for a row masked completely. After softmax subtracts the row's largest
    score, a masked entry sits at least ``max / 4`` minus the scores' spread below it, so
    ``exp`` is exactly 0; a row masked completely gives finite weights that sum to 1, not
    the NaN of a row of ``-inf``.

    ``safe_eps`` is ``1e-8`` as the dtype holds it, or ``smallest_normal`` where that is
    larger: a denominator epsilon that is a normal number of the dtype. In float16, 1e-8
    rounds to 0 (an Adam ``eps=1e-8`` stops protecting anything) and ``safe_eps`` is
    ``2**-14``; in bfloat16 and float32 it is 1e-8 rounded to the dtype.

    Example:
        >>> lim = limits(torch.float16)
        >>> lim.max, lim.smallest_normal, lim.smallest_subnormal, lim.eps
        (65504.0, 6.103515625e-05, 5.960464477539063e-08, 0.0009765625)
        >>> lim.safe_mask_value, lim.safe_eps
        (-16376.0, 6.103515625e-05)
    """

    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    safe_mask_value: float
    safe_eps: float


def _make_limits(dtype: torch.dtype, big: float, normal: float, subnormal: float, eps: float) -> Limits:
    as_dtype = torch.tensor(1e-8, dtype=dtype).item()  # 1e-8 as the dtype rounds it
    return Limits(dtype, big, normal, subnormal, eps, -big / 4, max(as_dtype, normal))


_LIMITS = {
    torch.float16: _make_limits(torch.float16, FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL, FP16_EPS),
    torch.bfloat16: _make_limits(torch.bfloat16, BF16_MAX, BF16_MIN_NORMAL, BF16_MIN_SUBNORMAL, BF16_EPS),
    torch.float32: _make_limits(torch.float32, FP32_MAX, FP32_MIN_NORMAL, FP32_MIN_SUBNORMAL, FP32_EPS),
}


def limits(dtype: torch.dtype) -> Limits:
    """The :class:`Limits` of ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.

    Example:
        >>> limits(torch.bfloat16).max
        3.3895313892515355e+38
        >>> limits(torch.float32).safe_eps
        9.99999993922529e-09
    """
    hint = "pass torch.float16, torch.bfloat16 or torch.float32"
    if isinstance(dtype, str):
        hint = f"pass torch.{dtype}" if isinstance(getattr(torch, dtype, None), torch.dtype) else hint
    check_choice("limits", "dtype", dtype, tuple(_LIMITS), hint + ".")
    return _LIMITS[dtype]


# -- stochastic rounding ----------------------------------------------------------------------------


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> Tensor:
    """Round float32 ``x`` to ``dtype`` (bfloat16 or float16) up or down at random, exact on average.

    Each finite value within ``dtype``'s finite range becomes one of its two neighbours in
    ``dtype``, the upper one with probability ``(x - lo) / (hi - lo)``, so ``E[result] == x``.
    Values that ``dtype`` holds exactly come back unchanged, the sign of zero included.
    ``inf``, ``-inf`` and NaN stay so. Beyond the largest finite value (``|x| > max``) the
    result is ``x.to(dtype)``'s: ``±max`` up to half a spacing above it, ``±inf`` from there;
    stochastic rounding never makes an ``inf`` that round-to-nearest would not.

    For bfloat16 the probability is exact (16 random bits added below the kept ones). For
    float16 it is drawn with 16 random bits: exact wherever ``|x| >= 2**-17`` (every normal
    float16 and most subnormals); below that, the bias is under ``2**-40`` in absolute value.

    The draws come from ``generator`` (on ``x``'s device), or from torch's default one; the
    same generator state gives the same result. The result is a new contiguous tensor of
    ``x``'s shape that does not require grad.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> stochastic_round(torch.tensor([1.0, 65504.0, 1e6]), torch.float16, generator=g)
        tensor([1.0000e+00, 6.5504e+04,        inf], dtype=torch.float16)
        >>> x = torch.full((10_000,), 1.0 + 0.3 * 2.0**-7)  # 30% of the way from 1.0 to the next bf16
        >>> round((stochastic_round(x, torch.bfloat16, generator=g) > 1).float().mean().item(), 2)
        0.3
    """
    call = "stochastic_round"
    _check_float_tensor(call, x, (torch.float32,))
    hint = "pass torch.bfloat16 or torch.float16"
    if dtype == torch.float32:
        hint = "a float32 x needs no rounding to float32: use it as it is"
    check_choice(call, "dtype", dtype, (torch.bfloat16, torch.float16), hint + ".")
    _check_generator(call, generator, x)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    flat = x.detach().contiguous().view(-1)
    out = _round_finite(flat, dtype, generator)
    out = _restore_specials(flat, out, dtype, check_first=flat.device.type == "cpu")
    return out.view(x.shape)


def _round_finite(flat: Tensor, dtype: torch.dtype, generator: torch.Generator | None) -> Tensor:
    """Stochastic rounding of a 1-D contiguous float32 tensor; right where ``|x| <= max`` only."""
    # Four 16-bit draws per 64-bit word: the CPU generator's cost is per call, not per bit.
    words = torch.empty((flat.numel() + 3) // 4, dtype=torch.int64, device=flat.device)
    words.random_(-(2**63), None, generator=generator)
    noise = words.view(torch.int16)[: flat.numel()].to(torch.int32).bitwise_and_(0xFFFF)
    bits = flat.view(torch.int32)
    if dtype == torch.bfloat16:
        # bfloat16 is the upper half of float32. Adding 16 random bits to the lower half
        # carries into the upper one with probability (lower half) / 2**16 = (|x| - lo) / (hi - lo),
        # for either sign (the bits are sign and magnitude), across binades and for subnormals.
        upper = noise.add_(bits).bitwise_right_shift_(16)
        return upper.to(torch.int16).view(torch.bfloat16)
    return _round_fp16(flat, bits, noise)


def _round_fp16(flat: Tensor, bits: Tensor, noise: Tensor) -> Tensor:
    # The float16 spacing at |x| is 2**(max(e, -14) - 10) where 2**e <= |x| < 2**(e + 1): made
    # from x's exponent bits, so all the arithmetic below is exact (powers of two and integers).
    spacing = torch.bitwise_and(bits, 0x7F800000).clamp_(min=(127 - 14) << 23).sub_(10 << 23)
    step = spacing.view(torch.float32)
    units = flat.abs().div_(step)  # |x| in spacings
    low = units.floor()
    fraction = units.sub_(low)
    uniform = noise.to(torch.float32).mul_(2.0**-16)  # 0, 2**-16, ..., 1 - 2**-16
    magnitude = low.add_(fraction.add_(uniform).floor_()).mul_(step)  # up with probability `fraction`
    sign = torch.bitwise_and(bits, -(2**31), out=spacing)
    return magnitude.view(torch.int32).bitwise_or_(sign).view(torch.float32).to(torch.float16)


def _restore_specials(flat: Tensor, out: Tensor, dtype: torch.dtype, check_first: bool) -> Tensor:
    """Where ``|x| > max`` or x is NaN, replace ``out`` by round-to-nearest (``x.to(dtype)``).

    With ``check_first`` one reduction decides whether there is anything to replace, which is
    cheaper than the replacement on CPU; elsewhere it would cost a device sync, so the
    replacement runs unconditionally.
    """
    top = limits(dtype).max
    if check_first:
        low, high = torch.aminmax(flat)
        if bool((low >= -top) & (high <= top)):  # False for NaN
            return out
    return torch.where(flat.abs() <= top, out, flat.to(dtype))


# -- fixed point --------------------------------------------------------------------------------------

_EXACT_WORD = {torch.float32: 25, torch.float64: 54}  # significand bits + 1: every <IL, FL> value exact


def fixed_point(
    x: Tensor,
    il: int,
    fl: int,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> Tensor:
    """``x`` on the ``<IL, FL>`` fixed-point grid of Gupta et al. 2015, in ``x``'s dtype.

    The grid has step ``eps = 2**-fl`` and range ``[-2**(il-1), 2**(il-1) - eps]`` (a word of
    ``il + fl`` bits, sign included). Values beyond the range saturate to its ends (``±inf``
    too); NaN stays NaN (fixed point has none; hiding it would hide a bug). Inside, with
    ``floor(x)`` the largest grid value ``<= x``, as in the paper:

    * ``"nearest"``: ``floor(x)`` if ``x <= floor(x) + eps/2``, else ``floor(x) + eps``. Ties go
      down, to the grid value below, for either sign (not torch.round's half-to-even).
    * ``"stochastic"``: ``floor(x) + eps`` with probability ``(x - floor(x)) / eps``, else
      ``floor(x)``; unbiased. The draw is uniform in x's dtype (24 or 53 bits), so the
      probability is exact wherever ``|x|`` is at least half a step.

    ``x`` is float32 (``il + fl <= 25``) or float64 (``il + fl <= 54``): within those every grid
    value and every step of the computation is exact. ``generator`` (on ``x``'s device) is for
    ``"stochastic"`` only.

    Example:
        >>> fixed_point(torch.tensor([0.3, 0.375, -0.375, 9.0, -9.0]), il=4, fl=2)
        tensor([ 0.2500,  0.2500, -0.5000,  7.7500, -8.0000])
        >>> g = torch.Generator().manual_seed(0)
        >>> round(fixed_point(torch.full((10_000,), 0.3), 4, 2, "stochastic", g).mean().item(), 2)
        0.3
    """
    call = "fixed_point"
    _check_float_tensor(call, x, tuple(_EXACT_WORD))
    check_int(call, "il", il, low=1, hint="pass the integer bits (sign included) as an int, e.g. il=2.")
    check_int(call, "fl", fl, low=0, hint="pass the fractional bits as an int, e.g. fl=14.")
    check_choice(call, "rounding", rounding, ("nearest", "stochastic"), "pass 'nearest' or 'stochastic'.")
    word = _EXACT_WORD[x.dtype]
    if il + fl > word:
        alt = (
            "use x.double() (IL + FL <= 54) or a shorter word"
            if x.dtype == torch.float32
            else "use fewer bits"
        )
        fail(
            call,
            passed=f"il={il}, fl={fl}",
            why=f"{x.dtype} holds {word} bits exactly, and IL + FL = {il + fl}",
            allowed=f"IL + FL <= {word} for a {x.dtype} x, so every value is exact",
            hint=alt + ".",
        )
    _check_generator(call, generator, x)
    if generator is not None and rounding == "nearest":
        got = f"generator={generator!r}, rounding='nearest'"
        fail(
            call,
            passed=got,
            why="rounding to nearest draws no random numbers",
            allowed="a generator with rounding='stochastic' only",
            hint="drop the generator or pass rounding='stochastic'.",
        )
    eps = 2.0**-fl
    top = 2.0 ** (il - 1)
    units = x.detach().clamp(-top, top - eps).mul_(2.0**fl)  # grid values are now integers
    low = units.floor()
    fraction = units.sub_(low)
    if rounding == "nearest":
        up = fraction > 0.5
    else:
        up = torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=generator) < fraction
    return low.add_(up.to(x.dtype)).mul_(eps)


# -- argument checks -----------------------------------------------------------------------------------


def _check_float_tensor(call: str, x: object, dtypes: tuple[torch.dtype, ...]) -> None:
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    if not isinstance(x, Tensor):
        hint = f"pass a tensor, e.g. torch.tensor(x, dtype=torch.{names.split(' ')[0]})."
        fail(call, passed=f"x={type(x).__name__}", allowed=f"a {names} tensor", hint=hint, error=TypeError)
    if x.dtype not in dtypes:
        hint = "convert it first with x.float()"
        if x.dtype in (torch.float16, torch.bfloat16) and call == "stochastic_round":
            hint = f"x is already {x.dtype}; round from the float32 values it came from, or x.float()"
        fail(
            call,
            passed=f"x=tensor of dtype {x.dtype}",
            allowed=f"a {names} tensor",
            hint=hint + ".",
            error=TypeError,
        )


def _check_generator(call: str, generator: object, x: Tensor) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        hint = "pass torch.Generator(device=x.device).manual_seed(seed), or None for torch's default."
        fail(
            call,
            passed=f"generator={generator!r}",
            allowed="a torch.Generator or None",
            hint=hint,
            error=TypeError,
        )
    where, device = generator.device, x.device
    same = where.type == device.type and (where.index is None or device.index in (None, where.index))
    if not same:
        got = f"generator on {where}, x on {device}"
        fail(
            call,
            passed=got,
            why="the random numbers must be drawn on x's device",
            allowed="a generator on x's device",
            hint=f"create it with torch.Generator(device={str(device)!r}).",
        )
