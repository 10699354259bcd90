"""What fp8 would do to a model, measured here: ``python -m amp_plugin doctor --fp8 [--model M:F]``.

For every ``nn.Linear`` whose dimensions fp8 accepts (multiples of 16), converted by the default
rule or not, the fp8 error of one forward and one backward on a sample batch: the SQNR (signal to
quantisation-noise ratio, in dB; higher is better, every 6 dB is one more correct bit) of the
layer's output and of its weight gradient, each against the same layer in fp32. The sample batch
is the layer's real input when ``inputs`` are given (captured by a forward hook while the model
runs them), else ``rows`` rows drawn from N(0, 1) with a fixed seed; the gradient of the output is
drawn from N(0, 1) too. Also: whether the device has fp8 matmul hardware.

Plain torch plus torchao (needed for the measurement; the hardware line and the layer choice
need nothing).
"""

from __future__ import annotations

import copy
import importlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from amp_plugin import fp8
from amp_plugin._imports import require_torchao
from amp_plugin._validation import check_module

__all__ = ["Fp8LayerError", "format_fp8_report", "fp8_hardware", "fp8_report", "sqnr_db"]

FP8_CAPABILITY = (8, 9)  # Ada and Hopper and later: fp8 tensor cores (torch._scaled_mm on CUDA)


def fp8_hardware() -> tuple[bool, str]:
    """Whether this machine has fp8 matmul hardware, and why (CUDA is not initialised without a GPU).

    Example:
        >>> has, why = fp8_hardware()
        >>> has or why.startswith("no")
        True
    """
    if not torch.cuda.is_available():
        return (
            False,
            "no: CPU only (torchao's fp8 runs through torch._scaled_mm's CPU kernel, slower than fp32)",
        )
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) >= FP8_CAPABILITY:
        return True, f"yes: {name} (CUDA capability {major}.{minor} >= 8.9 has fp8 tensor cores)"
    return False, f"no: {name} (CUDA capability {major}.{minor} < 8.9: no fp8 tensor cores)"


def sqnr_db(reference: Tensor, approximation: Tensor) -> float:
    """``10 log10(|reference|² / |reference - approximation|²)`` in dB; ``inf`` when they are equal.

    Example:
        >>> round(sqnr_db(torch.ones(4), torch.full((4,), 1.1)), 1)
        20.0
    """
    signal = reference.double().pow(2).sum().item()
    noise = (reference.double() - approximation.double()).pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass(frozen=True)
class Fp8LayerError:
    """One ``nn.Linear``: the rule's decision and its measured fp8 error (dB; ``None``: not fp8-shaped).

    Example:
        >>> Fp8LayerError("fc", 64, 64, True, "", 30.5, 28.0).converted
        True
    """

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str
    output_sqnr_db: float | None
    weight_grad_sqnr_db: float | None


def fp8_report(
    model: nn.Module,
    spec: fp8.Float8 | str = "tensorwise",
    *,
    inputs: Any = None,
    rows: int = 256,
    seed: int = 0,
) -> dict[str, Any]:
    """The fp8 report of ``model`` as a dict (``format_fp8_report`` prints it); ``model`` is not changed.

    ``inputs``: a batch to run the model on (a tensor, or a tuple of positional arguments) so each
    layer is measured on its real input; ``None`` measures on ``rows`` random rows per layer.

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 10))
        >>> try:
        ...     report = fp8_report(model, fp8.Float8(min_features=64))
        ... except ImportError:  # torchao is not installed
        ...     report = {"layers": [{"name": "0"}, {"name": "2"}, {"name": "3"}]}
        >>> [layer["name"] for layer in report["layers"]]
        ['0', '2', '3']
    """
    check_module("fp8_report", "model", model)
    spec = fp8.Float8.of(spec, "fp8_report") or fp8.Float8()
    require_torchao("doctor --fp8")
    started = time.perf_counter()
    choice = fp8.select_layers(model, spec)
    samples = _captured_inputs(model, inputs, rows) if inputs is not None else {}
    generator = torch.Generator().manual_seed(seed)
    layers = []
    decided = [(c, True) for c in choice.converted] + [(c, False) for c in choice.left_out]
    for layer, converted in sorted(decided, key=lambda d: _order(model, d[0].name)):
        linear = model.get_submodule(layer.name)
        errors: tuple[float | None, float | None] = (None, None)
        if isinstance(linear, nn.Linear) and not _odd(linear):
            x = samples.get(layer.name)
            if x is None:
                x = torch.randn(rows, linear.in_features, generator=generator)
            errors = _layer_errors(linear, x, spec, generator)
        layers.append(
            Fp8LayerError(layer.name, layer.in_features, layer.out_features, converted, layer.reason, *errors)
        )
    has, why = fp8_hardware()
    return {
        "recipe": spec.recipe,
        "summary": str(choice),
        "hardware": {"fp8": has, "detail": why},
        "layers": [asdict(layer) for layer in layers],
        "seconds": time.perf_counter() - started,
    }


def _order(model: nn.Module, name: str) -> int:
    return [n for n, _ in model.named_modules()].index(name)


def _odd(linear: nn.Linear) -> bool:
    return bool(linear.in_features % fp8.FP8_MULTIPLE or linear.out_features % fp8.FP8_MULTIPLE)


def _captured_inputs(model: nn.Module, inputs: Any, rows: int) -> dict[str, Tensor]:
    """Each Linear's first input while ``model`` runs ``inputs`` (flattened to rows, at most ``rows``)."""
    seen: dict[str, Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(_: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                if name not in seen and args and isinstance(args[0], Tensor):
                    seen[name] = args[0].detach().float().reshape(-1, args[0].shape[-1])[:rows].clone()

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _layer_errors(
    linear: nn.Linear, x: Tensor, spec: fp8.Float8, generator: torch.Generator
) -> tuple[float, float]:
    """SQNR (dB) of the fp8 layer's output and weight gradient against the fp32 layer's, same input."""
    float8 = importlib.import_module("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(spec.recipe)
    reference = copy.deepcopy(linear).float()
    quantised = float8.float8_linear.Float8Linear.from_float(copy.deepcopy(reference), config=config)
    x = x.to(reference.weight.device, torch.float32)
    grad_out = torch.randn(x.shape[0], linear.out_features, generator=generator).to(x.device)
    results = []
    for layer in (reference, quantised):
        out = layer(x)
        out.backward(grad_out)
        results.append((out.detach(), layer.weight.grad))
    (ref_out, ref_grad), (q_out, q_grad) = results
    assert ref_grad is not None and q_grad is not None  # both weights require grad (deep copies)
    return sqnr_db(ref_out, q_out), sqnr_db(ref_grad, q_grad)


def format_fp8_report(report: dict[str, Any]) -> str:
    """The report as text: the hardware line, the layer choice, one row per Linear layer.

    Example:
        >>> print(format_fp8_report({"recipe": "tensorwise", "summary": "fp8 (tensorwise): 0 of 0",
        ...     "hardware": {"fp8": False, "detail": "no: CPU only"}, "layers": [], "seconds": 0.1}))
        fp8 (recipe tensorwise)
          fp8 hardware: no: CPU only
          fp8 (tensorwise): 0 of 0
          measured in 0.10 s
    """
    lines = [
        f"fp8 (recipe {report['recipe']})",
        f"  fp8 hardware: {report['hardware']['detail']}",
        *(f"  {line}" for line in report["summary"].splitlines()),
    ]
    if report["layers"]:
        lines.append(f"  {'layer':<28} {'in x out':>12} {'fp8':>4} {'out dB':>7} {'wgrad dB':>8}  why not")
    for layer in report["layers"]:
        shape = f"{layer['in_features']}x{layer['out_features']}"
        lines.append(
            f"  {layer['name'] or '(root)':<28.28} {shape:>12} {'yes' if layer['converted'] else 'no':>4} "
            f"{_db(layer['output_sqnr_db']):>7} {_db(layer['weight_grad_sqnr_db']):>8}  {layer['reason']}"
        )
    lines.append(f"  measured in {report['seconds']:.2f} s")
    return "\n".join(lines)


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
