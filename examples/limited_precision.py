"""Training in 16-bit fixed point: round-to-nearest stalls, stochastic rounding keeps up with float.

A small reproduction of Gupta et al. 2015 ("Deep Learning with Limited Numerical Precision")
on scikit-learn's digits (8x8 images, 10 classes; the data ships with scikit-learn). A
64-100-10 ReLU MLP is trained by plain minibatch SGD with its weights, activations and
gradients all held in 16-bit fixed point ``<IL, FL>`` (``IL + FL = 16``), for FL = 14, 10
and 8, with :func:`amp_plugin.numerics.fixed_point` rounding either to nearest or
stochastically, and once in float32 as the baseline. Every run starts from the same weights
and sees the same batches. The net outputs a quarter of its logits (``SCALE``): at FL=14 the
range is [-2, 2), and full-size logits would saturate there whichever the rounding.

The grid step is ``2**-FL``. With round-to-nearest an SGD update smaller than half a step
is rounded away, so as FL shrinks more of the updates vanish and learning slows or stops;
stochastic rounding keeps each update in expectation, and tracks float at every FL.

    python examples/limited_precision.py           # about 10 s on 2 CPU cores
    python examples/limited_precision.py --smoke   # a few seconds, for the tests
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from amp_plugin.numerics import fixed_point

FLS = (14, 10, 8)
WORD = 16
ROUNDINGS = ("nearest", "stochastic")
SCALE = 4.0  # the net outputs logits / SCALE, so that <2, 14> (range [-2, 2)) can hold them


def load_digits_split(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Digits as float32 in [0, 1]: 1437 training and 360 test images, split with ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # one line that says what to install, not a traceback
        raise SystemExit(
            'limited_precision.py needs scikit-learn (its digits data set): pip install -e ".[examples]" '
            "(or pip install scikit-learn)"
        ) from None

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def train(
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    fl: int | None,
    rounding: str,
    epochs: int,
    lr: float,
    hidden: int = 100,
    batch: int = 32,
    seed: int = 0,
) -> list[float]:
    """Test error (%) after each epoch; ``fl=None`` trains in float32."""
    x_train, y_train, x_test, y_test = data
    g = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(seed + 1)  # the stochastic rounding's draws

    def q(t: Tensor) -> Tensor:
        if fl is None:
            return t
        gen = noise if rounding == "stochastic" else None
        return fixed_point(t, WORD - fl, fl, rounding, gen)  # type: ignore[arg-type]

    w1 = q((torch.rand(64, hidden, generator=g) * 2 - 1) / 8)
    w2 = q((torch.rand(hidden, 10, generator=g) * 2 - 1) / 10)
    b1, b2 = torch.zeros(hidden), torch.zeros(10)
    errors = []
    for _ in range(epochs):
        order = torch.randperm(len(y_train), generator=g)
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            x, y = x_train[idx], y_train[idx]
            pre = q(x @ w1 + b1)  # activations
            h = pre.clamp(min=0)
            logits = q(h @ w2 + b2)
            dlogits = torch.softmax(SCALE * logits, 1)
            dlogits[torch.arange(len(y)), y] -= 1
            dlogits = q(dlogits * (SCALE / len(y)))  # gradients
            dh = q(dlogits @ w2.T) * (pre > 0)
            grads = (q(x.T @ dh), q(dh.sum(0)), q(h.T @ dlogits), q(dlogits.sum(0)))
            w1, b1, w2, b2 = (q(p - lr * d) for p, d in zip((w1, b1, w2, b2), grads, strict=True))
        predict = q(q(x_test @ w1 + b1).clamp(min=0) @ w2 + b2).argmax(1)
        errors.append(100.0 * (predict != y_test).float().mean().item())
    return errors


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FLS), figsize=(4 * len(FLS), 3.2), sharey=True)
    for ax, fl in zip(axes, FLS, strict=True):
        for name, style in (("float32", "k-"), (f"FL={fl} nearest", "r--"), (f"FL={fl} stochastic", "b-")):
            ax.plot(range(1, len(curves[name]) + 1), curves[name], style, label=name)
        ax.set(title=f"<{WORD - fl}, {fl}> fixed point", xlabel="epoch", yscale="log")
        # One tick format on the log axis: plain numbers at 1-2-5 steps, no 10^k minor labels.
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend()
    axes[0].set_ylabel("test error (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(epochs: int, lr: float, report: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Every setting's test-error curve, the float32 baseline first."""
    data = load_digits_split(seed=0)
    curves = {"float32": train(data, None, "nearest", epochs, lr)}
    for fl in FLS:
        for rounding in ROUNDINGS:
            curves[f"FL={fl} {rounding}"] = train(data, fl, rounding, epochs, lr)
    report(f"{'setting':<20} {'<IL, FL>':>9} {'test error %':>13} {'best %':>7}")
    for name, errors in curves.items():
        fl = None if name == "float32" else int(name.split()[0].removeprefix("FL="))
        grid = "-" if fl is None else f"<{WORD - fl}, {fl}>"
        report(f"{name:<20} {grid:>9} {errors[-1]:>13.1f} {min(errors):>7.1f}")
    return curves


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--smoke", action="store_true", help="2 epochs: a quick check that it runs")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per setting (default 30, smoke 2)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument(
        "--plot", default="runs/limited_precision.png", help="where to write the PNG (needs matplotlib)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    epochs = args.epochs or (2 if args.smoke else 30)
    began = time.perf_counter()
    print(f"digits MLP 64-100-10, SGD lr={args.lr}, {epochs} epochs, 16-bit fixed point <16 - FL, FL>")
    curves = run(epochs, args.lr)
    plot(curves, Path(args.plot))
    print(f"plot written to {args.plot}  ({time.perf_counter() - began:.1f} s in all)")
    return curves


if __name__ == "__main__":
    main()
