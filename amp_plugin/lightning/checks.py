"""What ``AMPPrecision`` checks: its arguments, and at fit start what the Trainer hands over.

The fit-start side also reads the model it is handed: its device, the LightningModule inside a
strategy's wrapper, and whether any hook can look at the gradients between backward and step
(which decides the fast clipping path under ``clip_fused="auto"``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import LBFGS, Optimizer

from amp_plugin import autocast, diagnostics, fp32_policy, master_weights
from amp_plugin import precision as precisions
from amp_plugin._validation import check_bool, check_choice, check_int, fail
from amp_plugin.diagnostics.audit import join_names
from amp_plugin.master_weights import check_master_weights
from amp_plugin.optim import unwrap_optimizer
from amp_plugin.precision import check_precision
from amp_plugin.rounded_updates import ROUNDINGS
from amp_plugin.scaler import LossScaler

__all__ = [
    "LBFGS_HALF_WEIGHTS",
    "LBFGS_REFUSAL",
    "assigned_scaler",
    "check_arguments",
    "check_fit_start",
    "check_half_weights",
    "hooks_observe_gradients",
    "is_lbfgs",
    "lightning_module",
    "module_device",
    "resolve_settings",
    "scaler_property",
]

_OBSERVING_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")


def check_arguments(
    precision: object, scaler: object, clip_fused: object, lr_on_skip: object, guard: object = True
) -> None:
    """Raise ``ValueError`` / ``TypeError`` (what, allowed, ``HINT:``) for ``AMPPrecision`` arguments.

    Example:
        >>> check_arguments("16-mixed", LossScaler("cpu"), "auto", "hold")
        >>> check_arguments("bf16-mixed", LossScaler("cpu"), "auto", "hold")
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='bf16-mixed', scaler=LossScaler) is not allowed here: ... HINT: ...
    """
    check_precision(precision, "AMPPrecision")
    if scaler is not None and not isinstance(scaler, (LossScaler, torch.amp.GradScaler)):
        fail(
            "AMPPrecision",
            passed=f"scaler={scaler!r:.60}",
            allowed="an amp_plugin.LossScaler or a torch.amp.GradScaler",
            hint="pass LossScaler(...) (it takes GradScaler's arguments), or leave scaler=None.",
            error=TypeError,
        )
    if scaler is not None and precision in ("bf16-mixed", "bf16-true", "32-true"):
        fail(
            "AMPPrecision",
            passed=f"precision={precision!r}, scaler={type(scaler).__name__}",
            why=f"precision={precision!r} does not use a loss scaler",
            allowed="scaler= with '16-mixed' or '16-true' only",
            hint="drop scaler=, or use precision='16-mixed'.",
        )
    if scaler is not None and not scaler.is_enabled():
        fail(
            "AMPPrecision",
            passed=f"scaler={type(scaler).__name__} (disabled)",
            why="a disabled scaler would train fp16 with neither loss scaling nor an inf check",
            allowed="an enabled scaler, or scaler=None",
            hint=(
                "leave scaler=None (the plugin makes a LossScaler for the device it trains on), or pass one "
                "for that device, e.g. LossScaler('cpu'); a scaler for 'cuda' is disabled where CUDA is not "
                "available. fp16 without scaling, still guarded: LossScaler(init_scale=1.0, dynamic=False)."
            ),
        )
    check_bool("AMPPrecision", "guard", guard)

    if guard is False and precision in ("16-mixed", "16-true"):
        fail(
            "AMPPrecision",
            passed=f"precision={precision!r}, guard=False",
            why="fp16's loss scaler always checks and skips",
            allowed="guard=False with bf16 or fp32 only, where no loss scaler runs",
            hint="drop guard=False.",
        )
    if scaler is not None and precision == "auto":
        fail(
            "AMPPrecision",
            passed=f"precision='auto', scaler={type(scaler).__name__}",
            why="'auto' with a scaler is ambiguous: it picks bf16, which uses no scaler, where it can",
            allowed="scaler= with an explicit fp16 precision ('16-mixed' or '16-true')",
            hint="pass precision='16-mixed' together with the scaler.",
        )
    check_choice(
        "AMPPrecision", "clip_fused", clip_fused, ("auto", True, False), "use 'auto' (or a real bool)."
    )
    check_choice("AMPPrecision", "lr_on_skip", lr_on_skip, ("hold", "advance"), "use 'hold'.")


def assigned_scaler(
    call: str, precision: str, dtype: torch.dtype | None, scaler: object, grad_scaler: bool = True
) -> LossScaler | None:
    """The scaler ``plugin.scaler = scaler`` installs (a ``GradScaler`` converted); raise if it cannot work.

    ``precision`` is the plugin's, ``dtype`` its resolved one (``None`` while ``"auto"`` is not
    resolved). Refused: anything but a ``LossScaler`` (or, with ``grad_scaler``, a
    ``torch.amp.GradScaler``), a scaler for a precision without loss scaling, ``None`` for fp16
    (it would train without scaling), a disabled scaler.

    Example:
        >>> scaler = LossScaler("cpu", init_scale=4.0)
        >>> assigned_scaler("AMPPrecision", "16-mixed", torch.float16, scaler) is scaler
        True
        >>> assigned_scaler("AMPPrecision", "bf16-mixed", torch.bfloat16, LossScaler("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision.scaler(LossScaler) is not allowed here: ...
    """
    types = (LossScaler, torch.amp.GradScaler) if grad_scaler else (LossScaler,)
    what, prop = f"{type(scaler).__name__}", f"{call}.scaler"
    if scaler is not None and not isinstance(scaler, types):
        fail(
            prop,
            passed=f"{what} {scaler!r:.60}",
            allowed="an amp_plugin.LossScaler" + " or a torch.amp.GradScaler" * grad_scaler,
            hint="assign LossScaler(...) (it takes GradScaler's arguments).",
            error=TypeError,
        )
    fp16 = dtype == torch.float16 if dtype is not None else precision in ("16-mixed", "16-true")
    if scaler is not None and not fp16:
        why = (
            "'auto' is not resolved yet, and it picks bf16, which uses no scaler, where it can"
            if dtype is None and precision == "auto"
            else f"`precision={precision!r}` does not use a scaler; only fp16 ('16-mixed', '16-true') does"
        )
        fail(
            prop,
            passed=what,
            why=why,
            allowed="a scaler with fp16 ('16-mixed', '16-true') only",
            hint=f"leave {call}.scaler as None, or build the plugin with precision='16-mixed'.",
        )
    if scaler is None and fp16:
        fail(
            prop,
            passed="None",
            why=f"fp16 (precision={precision!r}) needs a loss scaler: without one it trains unscaled",
            allowed="a LossScaler",
            hint="assign a LossScaler, e.g. LossScaler('cpu') or LossScaler('cuda').",
        )
    new = LossScaler.from_grad_scaler(scaler) if isinstance(scaler, torch.amp.GradScaler) else scaler
    if new is not None and not new.is_enabled():
        fail(
            prop,
            passed=f"{what} (disabled)",
            why="a disabled scaler would train fp16 without loss scaling or an inf check",
            allowed="an enabled scaler",
            hint="assign one for the device you train on, e.g. LossScaler('cpu').",
        )
    return new


def scaler_property(call: str, doc: str, grad_scaler: bool = True, resolved_dtype: bool = True) -> property:
    """The ``scaler`` property of a plugin (``call`` names it in errors), one for every adapter.

    Reading gives the plugin's ``_scaler``. Assigning checks the new scaler with
    :func:`assigned_scaler` (``grad_scaler``: a ``torch.amp.GradScaler`` is taken and converted;
    ``resolved_dtype``: the plugin's ``dtype`` says whether it is fp16), hands it to the plugin's
    step driver if that was using the old one, and gives it the plugin's ``spike_guard`` if there
    is one. Before the plugin's own ``__init__`` has made its ``_driver`` (a base class's
    ``__init__`` assigning), the value is stored as it is.

    Example:
        >>> class Plugin:
        ...     precision, dtype, spike_guard = "16-mixed", torch.float16, None
        ...     scaler = scaler_property("Plugin", "The loss scaler.")
        ...     def __init__(self):
        ...         self._driver, self._scaler = None, LossScaler("cpu")
        >>> plugin = Plugin()
        >>> plugin.scaler = LossScaler("cpu", init_scale=8.0)
        >>> plugin.scaler.get_scale()
        8.0
        >>> plugin.scaler = None
        Traceback (most recent call last):
        ...
        ValueError: Plugin.scaler(None) is not allowed here: ...
    """

    def get(plugin: Any) -> LossScaler | None:
        scaler: LossScaler | None = plugin._scaler
        return scaler

    def set_(plugin: Any, scaler: LossScaler | torch.amp.GradScaler | None) -> None:
        if "_driver" not in plugin.__dict__:
            plugin._scaler = scaler
            return
        dtype = plugin.dtype if resolved_dtype else None
        new = assigned_scaler(call, str(plugin.precision), dtype, scaler, grad_scaler=grad_scaler)
        old, plugin._scaler = plugin._scaler, new
        driver = plugin._driver
        if driver is not None and old is not None and driver.scaler is old:
            driver.scaler = new  # the steps read the driver's scaler
        spike_guard = getattr(plugin, "spike_guard", None)
        if new is not None and spike_guard is not None:
            new.spike_guard = spike_guard

    return property(get, set_, doc=doc)


def resolve_settings(requested: str, device: object) -> tuple[str, torch.dtype, str]:
    """The autocast device type, dtype and precision name for ``AMPPrecision(requested)`` on ``device``.

    Says (rank zero) what ``"auto"`` chose, and warns when a CPU without fp16/bf16 instructions
    would emulate them (slower than fp32). Shared by the Trainer and the Fabric plugins.

    Example:
        >>> resolve_settings("32-true", "cpu")
        ('cpu', torch.float32, '32-true')
    """
    device_type = precisions.check_device(device, "AMPPrecision")
    dtype = precisions.resolve_precision(requested, device_type, call="AMPPrecision")
    name = requested
    if requested == "auto":
        name = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
        rank_zero_info(f"AMPPrecision('auto') chose {name}: {precisions.auto_precision_reason(device_type)}")
    note = precisions.cpu_emulation_note(dtype) if device_type == "cpu" else None
    if note is not None:  # a warning where "auto" chose it; information where it was asked for by name
        if requested == "auto":
            fix = "HINT: train in fp32 on this CPU (leave AMPPrecision out), or use a GPU or a CPU with AMX."
            _say_once(f"AMPPrecision({name!r}): {note}.\n{fix}", warn=True)  # two lines fit a terminal
        else:
            _say_once(f"AMPPrecision({name!r}): {note};\nleave AMPPrecision out for fp32.", warn=False)
    return device_type, dtype, name


@functools.cache
def _say_once(message: str, warn: bool) -> None:
    """Say ``message`` once per process (rank zero): as a warning, or as information."""
    (rank_zero_warn if warn else rank_zero_info)(message)


def check_half_weights(
    precision: str, master_weights: object, keep_fp32: object, rounding: object, rounding_seed: object
) -> tuple[type[nn.Module], ...] | None:
    """Check the half-precision-weight arguments of ``AMPPrecision``; return ``keep_fp32`` as a tuple.

    Master weights go with the "-mixed" precisions (and "auto"), a rounding other than
    "nearest" with the "-true" ones, where the weights have no fp32 copy.

    Example:
        >>> check_half_weights("16-mixed", True, None, "nearest", 0)
        >>> check_half_weights("bf16-true", True, None, "nearest", 0)
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='bf16-true', master_weights=True) is not allowed here: ...
    """

    check_master_weights("AMPPrecision", master_weights)
    if master_weights == "remainder" and precision != "bf16-mixed":
        fail(
            "AMPPrecision",
            passed=f"precision={precision!r}, master_weights='remainder'",
            why="an fp32 master is exactly a bf16 value plus 16 more bits, and no other precision's value",
            allowed="master_weights='remainder' with precision='bf16-mixed' only",
            hint="use precision='bf16-mixed', or master_weights=True (fp32 masters) for fp16.",
        )
    check_choice("AMPPrecision", "rounding", rounding, ROUNDINGS, "use 'stochastic' (or 'nearest').")
    check_int("AMPPrecision", "rounding_seed", rounding_seed, low=0)
    keep = None
    if keep_fp32 is not None:
        keep = fp32_policy.check_module_classes(keep_fp32, "AMPPrecision", "keep_fp32")
    true = precision.endswith("-true")
    if master_weights and true:
        fail(
            "AMPPrecision",
            passed=f"precision={precision!r}, master_weights=True",
            why=f"precision={precision!r} keeps the weights in half, with no fp32 copy to master",
            allowed="master weights with '16-mixed', 'bf16-mixed' or 'auto'",
            hint=(
                f"use precision={precision.replace('-true', '-mixed')!r} with master_weights=True (fp32 "
                "masters), or drop master_weights for weights held in half only."
            ),
        )
    if rounding != "nearest" and (not true or precision == "32-true"):
        fail(
            "AMPPrecision",
            passed=f"precision={precision!r}, rounding={rounding!r}",
            why="weights held in fp32 lose nothing to rounding",
            allowed="a rounding other than 'nearest' with '16-true' or 'bf16-true' only",
            hint=(
                "use precision='bf16-true' with rounding=..., or drop rounding (fp32 weights and masters "
                "round nothing away)."
            ),
        )
    if keep is not None and not (master_weights or precision in ("16-true", "bf16-true")):
        fail(
            "AMPPrecision",
            passed=f"keep_fp32={keep_fp32!r}",
            why="only a cast model has weights to keep in fp32",
            allowed="keep_fp32 with master_weights=True or a '16-true'/'bf16-true' precision",
            hint="drop keep_fp32; under autocast every weight stays fp32 anyway.",
        )
    return keep


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


def check_fit_start(
    model: nn.Module,
    optimizers: list[Optimizer],
    device: str,
    dtype: torch.dtype,
    grad_scaling: bool,
    weights: str = "fp32",
) -> None:
    """Refuse a setup that would fail later (``ValueError``); warn about one that would mislead.

    Checked is what the optimizers will step. Refused: LBFGS under loss scaling, with master
    weights or under a "-true" precision; with master weights (``weights="master"``), a trainable
    half parameter without an fp32 master (the optimizer would step it, and its fp16 state,
    directly); an ``eps`` that fp16 rounds to zero
    when the weights and optimizer state are fp16 (``weights="half"``: a zero second moment would
    divide by zero and write NaN into the weights); and the errors of
    :func:`~amp_plugin.diagnostics.check_optimizer_setup`. Its warnings, and a plain
    ``nn.DataParallel`` under bf16 (its replicas would run fp16), are warned about.
    ``weights`` is ``"fp32"``, ``"master"`` (fp32 masters) or ``"half"`` (a "-true" precision).

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
        optimizers,
        device_type=device,
        dtype=dtype,
        grad_scaling=grad_scaling,
        master_weights=weights != "fp32",
    )
    errors = [f.message for f in findings if f.severity == "error"]
    if errors:
        raise ValueError("AMPPrecision found problems at fit start:\n- " + "\n- ".join(errors))
    # stacklevel=5: the warnings name the caller's line (AMPPrecision.connect), not this helper's.
    for finding in findings:
        rank_zero_warn(finding.message, stacklevel=5)
    if dtype == torch.bfloat16 and (names := autocast.find_data_parallel(model)):
        rank_zero_warn(
            f"{', '.join(names)} is a plain nn.DataParallel: its replica threads would run fp16, not "
            "bf16 (torch re-enters only 'autocast enabled' there). HINT: wrap with "
            "amp_plugin.AutocastDataParallel instead.",
            stacklevel=5,
        )


def _check_masters(model: nn.Module, optimizers: list[Optimizer]) -> None:
    masters = master_weights.masters_of(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        opt = unwrap_optimizer(optimizer)
        bare = [
            p
            for group in opt.param_groups
            for p in group["params"]
            if p.requires_grad
            and p.dtype in (torch.float16, torch.bfloat16)
            and (masters is None or masters.master_of(p) is None)
        ]
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


def _check_fp16_eps(optimizers: list[Optimizer]) -> None:
    smallest_normal = torch.finfo(torch.float16).tiny
    for optimizer in optimizers:
        opt = unwrap_optimizer(optimizer)
        for group in opt.param_groups:
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and 0 <= eps < smallest_normal:
                fail(
                    "AMPPrecision('16-true')",
                    passed=f"{type(opt).__name__}(eps={eps!r})",
                    why=(
                        "in fp16 optimizer state that eps rounds to 0, and a zero second moment then "
                        "divides by zero and writes NaN into the weights"
                    ),
                    allowed=f"eps >= {smallest_normal:.3g} (fp16's smallest normal number)",
                    hint=(
                        f"build {type(opt).__name__}(..., eps=1e-4), or use precision='16-mixed' with "
                        "master_weights=True, or 'bf16-true'."
                    ),
                )


def lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper (DDP, ...), or ``model`` itself.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> module = BoringModel()
        >>> wrapper = torch.nn.Module()
        >>> wrapper.module = module
        >>> lightning_module(wrapper) is module, lightning_module(module) is module
        (True, True)
    """
    for _ in range(4):
        inner = getattr(model, "module", None)
        if isinstance(model, LightningModule) or not isinstance(inner, nn.Module):
            break
        model = inner
    return model


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


def hooks_observe_gradients(model: LightningModule, trainer: Trainer) -> bool:
    """Whether the module or a callback can look at gradients between backward and step.

    That is, whether the module overrides ``on_before_optimizer_step`` or
    ``configure_gradient_clipping``, or a callback overrides ``on_before_optimizer_step``.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Observer(Callback):
        ...     def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ...         pass
        >>> trainer = Trainer(accelerator="cpu", logger=False, callbacks=[Observer()])
        >>> hooks_observe_gradients(BoringModel(), trainer)
        True
        >>> hooks_observe_gradients(BoringModel(), Trainer(accelerator="cpu", logger=False))
        False
    """
    if any(is_overridden(hook, model, LightningModule) for hook in _OBSERVING_HOOKS):
        return True
    return any(
        is_overridden("on_before_optimizer_step", cb, Callback) for cb in getattr(trainer, "callbacks", [])
    )
