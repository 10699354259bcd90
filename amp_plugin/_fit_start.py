"""What a run checks when training starts: the model and the optimizers it is handed, against its precision.

Plain torch, shared by every adapter (the Trainer's plugin at ``connect``, Fabric's at its first step
or ``attach``): a set-up that would fail later is refused (``ValueError``, nothing changed); one
that would mislead is reported through ``say``, the adapter's way of warning on rank zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.optim import LBFGS, Optimizer

from amp_plugin import autocast, diagnostics, master_weights
from amp_plugin._optim import unwrap_optimizer
from amp_plugin._sharding import has_dtensor
from amp_plugin._validation import fail
from amp_plugin.diagnostics._audit import join_names

__all__ = [
    "LBFGS_HALF_WEIGHTS",
    "LBFGS_REFUSAL",
    "LBFGS_UNGUARDED",
    "check_fit_start",
    "is_lbfgs",
    "module_device",
]

LBFGS_REFUSAL = (
    "AMPPrecision('16-mixed') cannot drive LBFGS: it evaluates its closure several times per step, "
    "which loss scaling cannot skip safely. HINT: use precision='bf16-mixed' or another optimizer."
)

LBFGS_HALF_WEIGHTS = (
    "AMPPrecision cannot drive LBFGS with master weights or a '-true' precision: LBFGS evaluates its "
    "closure several times per step on the weights it updates, which the fp32 masters and the rounded "
    "half writes do not follow. HINT: use precision='bf16-mixed' (or '32-true') without master_weights."
)

LBFGS_UNGUARDED = (
    "AMPPrecision steps LBFGS with its closure, which it runs several times per step: its steps are "
    "not checked for inf/NaN gradients (and not counted as skipped), as under Lightning's own plugins."
)


def is_lbfgs(optimizer: object) -> bool:
    """Whether ``optimizer`` (or the optimizer a Lightning wrapper holds) is ``LBFGS``.

    Example:
        >>> is_lbfgs(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))
        True
    """
    return isinstance(unwrap_optimizer(optimizer), LBFGS)


def module_device(model: nn.Module) -> str:
    """The device type of ``model`` (its ``.device``, else its first parameter's; ``"cpu"`` without any).

    Example:
        >>> module_device(torch.nn.Linear(2, 1)), module_device(torch.nn.ReLU())
        ('cpu', 'cpu')
    """
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device.type
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def check_fit_start(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    device: str,
    dtype: torch.dtype,
    grad_scaling: bool,
    weights: str = "fp32",
    say: Callable[[str, bool], None] | None = None,
) -> None:
    """Refuse a setup that would fail later (``ValueError``); ``say`` (warn) about one that would mislead.

    Checked is what the optimizers will step. Refused: LBFGS under loss scaling, with master
    weights or under a "-true" precision; with master weights (``weights="master"``), a trainable
    half parameter without an fp32 master (the optimizer would step it, and its fp16 state,
    directly); an ``eps`` that fp16 rounds to zero when the weights and optimizer state are fp16
    (``weights="half"``: a zero second moment would divide by zero and write NaN into the weights);
    and the errors of :func:`~amp_plugin.diagnostics.check_optimizer_setup`. Its warnings, and a
    plain ``nn.DataParallel`` under bf16 (its replicas would run fp16), go to ``say(message, True)``
    (``None``: not said). ``weights`` is ``"fp32"``, ``"master"`` (fp32 masters) or ``"half"`` (a
    "-true" precision).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> check_fit_start(model, [torch.optim.SGD(model.parameters())], "cpu", torch.float16, True)
        >>> check_fit_start(model, [torch.optim.LBFGS(model.parameters())], "cpu", torch.float16, True)
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision('16-mixed') cannot drive LBFGS: ... HINT: use precision='bf16-mixed' ...
    """
    if (grad_scaling or weights != "fp32") and any(map(is_lbfgs, optimizers)):
        raise ValueError(LBFGS_REFUSAL if grad_scaling else LBFGS_HALF_WEIGHTS)
    if dtype == torch.float32:
        return  # "32-true": no autocast, nothing mixed to check
    if weights == "master":
        _check_masters(model, optimizers)
    if weights == "half" and dtype == torch.float16:
        _check_fp16_eps(optimizers)
    # With master weights or "-true" precisions the half parameters are the plugin's own doing.
    findings = diagnostics.check_optimizer_setup(
        model,
        list(optimizers),
        device_type=device,
        dtype=dtype,
        grad_scaling=grad_scaling,
        master_weights=weights != "fp32",
    )
    errors = [f.message for f in findings if f.severity == "error"]
    if errors:
        raise ValueError("AMPPrecision found problems at fit start:\n- " + "\n- ".join(errors))
    said = [finding.message for finding in findings]
    if dtype == torch.bfloat16 and (names := autocast.find_data_parallel(model)):
        said.append(
            f"{', '.join(names)} is a plain nn.DataParallel: its replica threads would run fp16, not "
            "bf16 (torch re-enters only 'autocast enabled' there). HINT: wrap with "
            "amp_plugin.AutocastDataParallel instead."
        )
    if say is not None:
        for message in said:
            say(message, True)


def _check_masters(model: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    masters = master_weights.masters_of(model)
    names = {id(p): n for n, p in model.named_parameters()}
    # A remainder master is bf16 while it carries the model's bf16 gradient to the step.
    own = set() if masters is None else {id(m) for m in masters.masters()}
    for i, optimizer in enumerate(optimizers):
        opt = unwrap_optimizer(optimizer)
        bare = [
            p
            for group in opt.param_groups
            for p in group["params"]
            if p.requires_grad
            and p.dtype in (torch.float16, torch.bfloat16)
            and (masters is None or masters.master_of(p) is None)
            and id(p) not in own
        ]
        if bare and has_dtensor(bare):  # sharded after the cast (Fabric shards after converting)
            master_weights.refuse_sharded("AMPPrecision", [names.get(id(p), "?") for p in bare])
        if bare:
            raise ValueError(
                f"AMPPrecision(master_weights=True): optimizer {i} ({type(opt).__name__}) steps "
                f"{len(bare)} {str(bare[0].dtype)[6:]} parameter(s) "
                f"({join_names([names.get(id(p), '?') for p in bare])}) that have no fp32 master, so it "
                "would update them, and keep their state, in half precision. Masters are made when the "
                "model is cast (before configure_optimizers) for the parameters that require grad then. "
                "HINT: set requires_grad before fit (in __init__ or configure_model), not in "
                "configure_optimizers; or leave those parameters out of the optimizer."
            )


def _check_fp16_eps(optimizers: Sequence[Optimizer]) -> None:
    smallest_normal = torch.finfo(torch.float16).tiny
    for optimizer in optimizers:
        opt = unwrap_optimizer(optimizer)
        for group in opt.param_groups:
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and 0 <= eps < smallest_normal:
                stored = float(torch.tensor(float(eps), dtype=torch.float16))
                why = (
                    "in fp16 optimizer state that eps rounds to 0, and a zero second moment then "
                    "divides by zero and writes NaN into the weights"
                    if stored == 0
                    else f"in fp16 optimizer state that eps is subnormal (stored as {stored:.3g}), and where "
                    "a gradient's square underflows to 0 the step m / eps is then far larger than lr"
                )
                fail(
                    "AMPPrecision('16-true')",
                    passed=f"{type(opt).__name__}(eps={eps!r})",
                    why=why,
                    allowed=f"eps >= {smallest_normal:.3g} (fp16's smallest normal number)",
                    hint=(
                        f"build {type(opt).__name__}(..., eps=1e-4), or use precision='16-mixed' with "
                        "master_weights=True, or 'bf16-true'."
                    ),
                )
