"""FP8 training through torchao: which ``nn.Linear`` layers run their matmuls in fp8, and their conversion.

Plain torch plus torchao (an optional dependency, imported only by :func:`convert`). The adapters
(``AMPPrecision(fp8=...)`` for the Trainer and for Fabric) call :func:`convert` when they convert
the model; everything else (autocast, the guard, clipping) stays as in a bf16 run.

Which layers (:func:`select_layers`), by default:

* only ``nn.Linear`` layers whose ``in_features`` and ``out_features`` are both multiples of 16
  (what the fp8 matmul kernels accept);
* only layers with both dimensions ``>= min_features`` (default :data:`MIN_FEATURES` = 1024):
  below that the casts to fp8 cost more than the fp8 matmul saves (torchao's own automatic
  filter, tuned on H100, skips layers below about that size too);
* never ``nn.MultiheadAttention``'s ``out_proj`` (attention reads its weight directly, so a
  Float8Linear there would never run) nor an ``nn.Linear`` subclass that overrides ``forward``
  (torchao's Float8Linear would replace that forward), nor a layer inside the plugin's
  ``fp32_modules`` (they run in fp32, as asked);
* never the first and the last ``nn.Linear`` of the model (in registration order: typically an
  input projection and the LM head), nor a layer whose weight is shared with another module (a
  tied embedding): these are the layers where fp8's 3-4 significant bits hurt accuracy most.

A user filter (``filter=``: fully-qualified layer names, or a predicate ``(module, name) -> bool``)
replaces the size, first/last and tied-weight rules; the multiple-of-16, own-forward and
``fp32_modules`` rules always hold.

Checkpoints stay ordinary: torchao's ``Float8Linear`` keeps the original fp32 parameters, so its
state dict holds plain tensors under the same keys (with ``all_gather=True`` the weight is a
torchao tensor subclass, unwrapped by a state-dict hook), and it loads into the model without
fp8. torchao's scaling is dynamic (computed from each tensor as it is cast; there is no
amax history), so a resume under fp8 continues bit-exactly.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 10))
    >>> report = select_layers(model, Float8(min_features=64))
    >>> report.converted_names
    ('2',)
    >>> print(report)  # doctest: +NORMALIZE_WHITESPACE
    fp8 (tensorwise): 1 of 3 Linear layers, 4,160 of 6,922 Linear parameters (60.1%)
      left out: 0 (first Linear layer), 3 (dims 64x10 not multiples of 16)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, cast

from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from amp_plugin._imports import require_torchao
from amp_plugin._sharding import has_dtensor
from amp_plugin._validation import check_bool, check_choice, check_int, check_module, fail
from amp_plugin.fp32_policy import check_module_classes

__all__ = ["RECIPES", "Float8", "Float8Report", "convert", "select_layers"]

Recipe: TypeAlias = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
RECIPES: tuple[Recipe, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8_MULTIPLE = 16  # torch._scaled_mm needs both matrix dimensions to be multiples of 16
MIN_FEATURES = 1024  # below this a layer's fp8 casts cost more than its fp8 matmul saves
LayerFilter: TypeAlias = Collection[str] | Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class Float8:
    """What to run in fp8: the torchao recipe and which ``nn.Linear`` layers.

    Args:
        recipe: torchao's float8 recipe: ``"tensorwise"`` (one scale per tensor; the fastest),
            ``"rowwise"`` (one scale per row: more accurate with outliers) or
            ``"rowwise_with_gw_hp"`` (rowwise, with the weight gradient computed in high precision).
        filter: which layers to convert instead of the default rule: a collection of
            fully-qualified module names (each must name an ``nn.Linear``), or a predicate
            ``(module, name) -> bool`` called for every ``nn.Linear``.
        min_features: the default rule's size threshold: both dimensions must be at least this.
        keep_ends: the default rule keeps the first and the last ``nn.Linear`` in high precision.
        all_gather: FSDP2 all-gathers the weights in fp8 (torchao's
            ``enable_fsdp_float8_all_gather``; ``"tensorwise"`` only).

    Example:
        >>> Float8("rowwise").recipe
        'rowwise'
        >>> Float8("blockwise")
        Traceback (most recent call last):
        ...
        ValueError: Float8(recipe='blockwise') is not allowed here: it is none of the choices. ...
    """

    recipe: Recipe = "tensorwise"
    filter: LayerFilter | None = field(default=None, hash=False)  # names are kept as a frozenset
    min_features: int = MIN_FEATURES
    keep_ends: bool = True
    all_gather: bool = False

    def __post_init__(self) -> None:
        check_choice("Float8", "recipe", self.recipe, RECIPES, "use 'tensorwise' (or 'rowwise').")
        check_int("Float8", "min_features", self.min_features, low=FP8_MULTIPLE)
        check_bool("Float8", "keep_ends", self.keep_ends)
        check_bool("Float8", "all_gather", self.all_gather)
        if self.all_gather and self.recipe != "tensorwise":
            fail(
                "Float8",
                passed=f"recipe={self.recipe!r}, all_gather=True",
                why="torchao all-gathers in fp8 only for the tensorwise recipe",
                allowed="all_gather=True with recipe='tensorwise' only",
                hint="use recipe='tensorwise', or drop all_gather.",
            )
        flt = self.filter
        if flt is not None and not callable(flt):
            names_ok = isinstance(flt, Collection) and not isinstance(flt, str)
            if not names_ok or not all(isinstance(n, str) for n in flt):
                fail(
                    "Float8",
                    passed=f"filter={flt!r:.60}",
                    allowed="a collection of module names, or a callable (module, name) -> bool",
                    hint="pass e.g. filter={'blocks.0.mlp.fc1'} or filter=lambda module, name: 'mlp' in name",
                    error=TypeError,
                )
            object.__setattr__(
                self, "filter", frozenset(flt)
            )  # frozen: a caller's later edits do not leak in

    @classmethod
    def of(cls, value: object, call: str = "AMPPrecision") -> Float8 | None:
        """``value`` as a :class:`Float8`: a recipe name becomes ``Float8(recipe)``; ``None`` stays ``None``.

        Example:
            >>> Float8.of("rowwise") == Float8("rowwise"), Float8.of(None)
            (True, None)
        """
        if value is None or isinstance(value, Float8):
            return value
        if isinstance(value, str):
            check_choice(call, "fp8", value, RECIPES, "use fp8='tensorwise' (or Float8(recipe=...)).")
            return cls(value)  # type: ignore[arg-type]  # checked just above
        fail(
            call,
            passed=f"fp8={value!r:.60}",
            allowed="None, a recipe name (" + ", ".join(map(repr, RECIPES)) + ") or an amp_plugin.fp8.Float8",
            hint="pass fp8='tensorwise', or fp8=Float8(recipe='rowwise', filter=...).",
            error=TypeError,
        )


@dataclass(frozen=True)
class LayerChoice:
    """One ``nn.Linear`` and the decision about it (``reason`` says why it stays in high precision).

    Example:
        >>> from torch import nn
        >>> choice = select_layers(nn.Linear(16, 20)).left_out[0]
        >>> choice.parameters, choice.reason
        (340, 'dims 16x20 not multiples of 16')
    """

    name: str
    in_features: int
    out_features: int
    parameters: int
    reason: str = ""


@dataclass(frozen=True)
class Float8Report:
    """Which ``nn.Linear`` layers run in fp8 and why the others do not; ``str()`` reads as a summary.

    Example:
        >>> from torch import nn
        >>> report = select_layers(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)),
        ...                        Float8(min_features=16))
        >>> report.converted_names, report.converted_parameters, report.linear_parameters
        (('1',), 1056, 2128)
    """

    recipe: Recipe
    converted: tuple[LayerChoice, ...]
    left_out: tuple[LayerChoice, ...]

    @property
    def converted_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.converted)

    @property
    def converted_parameters(self) -> int:
        """Parameters (weights and biases) of the converted layers."""
        return sum(c.parameters for c in self.converted)

    @property
    def linear_parameters(self) -> int:
        """Parameters of every ``nn.Linear`` in the model, converted or not."""
        return self.converted_parameters + sum(c.parameters for c in self.left_out)

    def __str__(self) -> str:
        total, done = len(self.converted) + len(self.left_out), self.converted_parameters
        share = done / self.linear_parameters if self.linear_parameters else 0.0
        lines = [
            f"fp8 ({self.recipe}): {len(self.converted)} of {total} Linear layers, "
            f"{done:,} of {self.linear_parameters:,} Linear parameters ({share:.1%})"
        ]
        if self.left_out:
            # Three by name keeps the line readable in a terminal; the doctor's table lists them all.
            shown = ", ".join(f"{c.name} ({c.reason})" for c in self.left_out[:3])
            more = len(self.left_out) - 3
            lines.append(f"  left out: {shown}" + (f", and {more} more" if more > 0 else ""))
        return "\n".join(lines)


def check_fp8_request(
    call: str, fp8: object, precision: object, master_weights: object = False
) -> Float8 | None:
    """``fp8`` as a :class:`Float8` (``None`` when off) if the plugin can run it; else a clear error.

    fp8 runs inside bf16 autocast: ``precision="bf16-mixed"`` only (torchao's float8 recipes are
    built and tested for bf16; fp16 with loss scaling on top is not supported here), with fp32
    weights (no ``master_weights``). Needs torchao (``ImportError`` with the install command).
    Everything is checked before anything is set.

    Example:
        >>> check_fp8_request("AMPPrecision", None, "16-mixed") is None
        True
        >>> check_fp8_request("AMPPrecision", "tensorwise", "16-mixed")
        Traceback (most recent call last):
        ...
        ValueError: AMPPrecision(precision='16-mixed', fp8='tensorwise') is not allowed here: fp8 runs ...
    """
    spec = Float8.of(fp8, call)
    if spec is None:
        return None
    shown = repr(fp8) if isinstance(fp8, str) else f"Float8({spec.recipe!r}, ...)"
    # The missing package first: a user who fixes the precision should not then learn of torchao.
    require_torchao(f"{call}(fp8={shown})")
    if precision != "bf16-mixed":
        fail(
            call,
            passed=f"precision={precision!r}, fp8={shown}",
            why="fp8 runs inside bf16 autocast",
            allowed="precision='bf16-mixed' with fp8 (the layers outside fp8 run under bf16 autocast)",
            hint="use precision='bf16-mixed' together with fp8=... (fp8 hardware always has bf16).",
        )
    if master_weights is True or master_weights == "remainder":
        fail(
            call,
            passed=f"fp8={shown}, master_weights={master_weights!r}",
            why="torchao keeps the fp32 weights and casts them per matmul: they are the masters",
            allowed="fp8 with master_weights=False (the default)",
            hint="drop master_weights: the fp32 weights are the masters already.",
        )
    return spec


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            yield name, module


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (tied weights).

    Counted per module, not per path: a module reachable twice (a compiled wrapper around the
    model) does not make its parameters shared.
    """
    holders: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def _default_reason(spec: Float8, linear: nn.Linear, index: int, count: int, shared: set[int]) -> str | None:
    if spec.keep_ends and index == 0:
        return "first Linear layer"
    if spec.keep_ends and index == count - 1:
        return "last Linear layer"
    if id(linear.weight) in shared:
        return "weight shared with another module"
    if min(linear.in_features, linear.out_features) < spec.min_features:
        return f"smaller than min_features={spec.min_features}"
    return None


def select_layers(
    model: nn.Module, spec: Float8 | str = "tensorwise", fp32_modules: Sequence[type[nn.Module]] = ()
) -> Float8Report:
    """Decide which ``nn.Linear`` layers of ``model`` run in fp8; change nothing (torchao is not needed).

    Layers that are, or sit inside, an instance of ``fp32_modules`` (the plugins' argument: modules
    that run in fp32) stay out whatever the filter says.

    Raises ``ValueError`` when ``spec.filter`` names a module that is not an ``nn.Linear`` of
    ``model``, or one that no filter can convert (dimensions not multiples of 16, attention's
    ``out_proj``, a subclass with its own ``forward``).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 50), nn.Linear(64, 64))
        >>> [(c.name, c.reason) for c in select_layers(model, Float8(filter={"0"})).left_out]
        [('1', 'dims 64x50 not multiples of 16'), ('2', 'not selected by the filter')]
    """
    check_module("select_layers", "model", model)
    spec = Float8.of(spec, "select_layers") or Float8()
    classes = check_module_classes(fp32_modules, "select_layers", "fp32_modules")
    linears = list(_linears(model))
    in_fp32 = _in_fp32_modules(model, classes)
    _check_named_filter(spec, dict(linears), in_fp32)
    shared = _shared_parameter_ids(model) if spec.filter is None else set()
    converted: list[LayerChoice] = []
    left_out: list[LayerChoice] = []
    for index, (name, linear) in enumerate(linears):
        params = sum(p.numel() for p in linear.parameters(recurse=False))
        reason = in_fp32.get(name) or _reason(spec, name, linear, index, len(linears), shared)
        choice = LayerChoice(name, linear.in_features, linear.out_features, params, reason or "")
        (left_out if reason else converted).append(choice)
    return Float8Report(spec.recipe, tuple(converted), tuple(left_out))


def _reason(
    spec: Float8, name: str, linear: nn.Linear, index: int, count: int, shared: set[int]
) -> str | None:
    """Why ``linear`` stays in high precision, or ``None`` when it runs in fp8."""
    if (reason := _cannot_convert(linear)) is not None:
        return reason
    if spec.filter is None:
        return _default_reason(spec, linear, index, count, shared)
    chosen = spec.filter(linear, name) if callable(spec.filter) else name in spec.filter
    return None if chosen else "not selected by the filter"


def _in_fp32_modules(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> dict[str, str]:
    """Names of the modules that are or sit inside an instance of ``classes``, with the reason."""
    if not classes:
        return {}
    inside: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, classes) and name not in inside:
            reason = f"in fp32_modules ({type(module).__name__})"
            for sub, _ in module.named_modules(prefix=name):
                inside.setdefault(sub, reason)
    return inside


def _check_named_filter(spec: Float8, linears: dict[str, nn.Linear], in_fp32: dict[str, str]) -> None:
    if spec.filter is None or callable(spec.filter):
        return
    unknown = sorted(n for n in spec.filter if n not in linears)
    if unknown:
        fail(
            "Float8",
            passed=f"filter={sorted(spec.filter)!r:.80}",
            why=f"the model has no nn.Linear named {unknown[0]!r}",
            allowed=f"names of the model's nn.Linear layers; not one: {unknown[:5]}",
            hint="use the names of model.named_modules() (e.g. 'blocks.0.mlp.fc1'), or a predicate.",
        )
    reasons = {n: in_fp32.get(n) or _cannot_convert(linears[n]) for n in spec.filter}
    odd = sorted(n for n, reason in reasons.items() if reason is not None)
    if odd:
        fail(
            "Float8",
            passed=f"filter={sorted(spec.filter)!r:.80}",
            why=f"{odd[0]!r} cannot run in fp8 ({reasons[odd[0]]})",
            allowed=(
                f"plain nn.Linear layers whose in/out features are multiples of {FP8_MULTIPLE}, "
                f"outside fp32_modules; not so: {odd[:5]} ({reasons[odd[0]]})"
            ),
            hint="leave those layers out of the filter (they run in bf16), or pad their dimensions.",
        )


def _cannot_convert(linear: nn.Linear) -> str | None:
    """Why no filter can put ``linear`` in fp8 (the rules that always hold), or ``None``."""
    if linear.in_features % FP8_MULTIPLE or linear.out_features % FP8_MULTIPLE:
        return f"dims {linear.in_features}x{linear.out_features} not multiples of {FP8_MULTIPLE}"
    if isinstance(linear, NonDynamicallyQuantizableLinear):
        # MultiheadAttention's forward reads out_proj.weight itself: a Float8Linear there never runs.
        return "MultiheadAttention's out_proj (its forward never runs)"
    if type(linear).forward is not nn.Linear.forward and not _is_float8(linear):
        return f"{type(linear).__name__} overrides forward (torchao's Float8Linear would replace it)"
    return None


def convert(
    model: nn.Module, spec: Float8 | str = "tensorwise", fp32_modules: Sequence[type[nn.Module]] = ()
) -> Float8Report:
    """Swap the layers :func:`select_layers` chooses for torchao's ``Float8Linear``, in place.

    The parameters are kept (the same ``nn.Parameter`` objects, so optimizers built before still
    step them), except with ``all_gather=True``: torchao wraps each converted weight in a new
    ``nn.Parameter`` (on the same storage), so build optimizers after the conversion (Fabric's
    ``AMPPrecision`` re-points the optimizers handed to ``fabric.setup``). The state dict keeps
    its keys and plain tensors. Layers that run in fp8 already are left as they are. Needs
    torchao (``ImportError`` with the install command).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
        >>> try:
        ...     print(convert(model, Float8(min_features=64)).converted_names)
        ... except ImportError:
        ...     print(("1",))  # torchao is not installed
        ('1',)
    """
    check_module("convert", "model", model)
    spec = Float8.of(spec, "convert") or Float8()
    require_torchao(f"AMPPrecision(fp8={spec.recipe!r})")
    report = select_layers(model, spec, fp32_modules)
    chosen = set(report.converted_names) - set(float8_layer_names(model))
    if not chosen:
        return report
    _check_not_sharded(model, sorted(chosen))
    float8 = importlib.import_module("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(spec.recipe)
    if spec.all_gather:
        config = _with_all_gather(config)
    float8.convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in chosen, config=config)
    if spec.all_gather:
        for name in chosen:
            model.get_submodule(name)._register_state_dict_hook(_plain_weight)
    return report


def _check_not_sharded(model: nn.Module, names: list[str]) -> None:
    """Refuse layers that ``fully_shard`` already owns: FSDP2 would keep unsharding into the old module."""
    sharded = [n for n in names if has_dtensor([cast(Tensor, model.get_submodule(n).weight)])]
    if sharded:
        fail(
            "convert",
            passed=f"a model whose Linear layers are sharded already ({', '.join(sharded[:3])}, ...)",
            why="torchao must swap the layers before fully_shard wraps their weights",
            allowed="a model converted to fp8 before fully_shard (FSDP2) shards it",
            hint=(
                "call amp_plugin.fp8.convert(model, spec) before fully_shard; in a LightningModule's "
                "configure_model, before its fully_shard calls, with the spec given to AMPPrecision(fp8=...) "
                "(the plugin then finds the layers converted and only reports them)."
            ),
        )


def _with_all_gather(config: Any) -> Any:
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True)


def _plain_weight(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    """State-dict hook: store the fp8 all-gather weight as the plain tensor it wraps."""
    key = prefix + "weight"
    if key in state:
        state[key] = plain_tensor(state[key])


def plain_tensor(tensor: Tensor) -> Tensor:
    """``tensor`` without torchao's fp8 weight wrapper (DTensor shards keep their DTensor shell).

    Example:
        >>> import torch
        >>> plain_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # a process that never imported it has none
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        shard = tensor.to_local()
        local = plain_tensor(shard)
        if local is shard:
            return cast(Tensor, tensor)
        plain: Tensor = dtensor.DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False
        )
        return plain
    # torchao's WeightWithDynamicFloat8CastTensor (its state-dict copy is a Parameter of that class)
    inner = getattr(tensor, "_tensor", None)
    wrapped = isinstance(inner, Tensor) and hasattr(tensor, "_linear_mm_config")
    return inner.detach() if wrapped and isinstance(inner, Tensor) else tensor


def float8_layer_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the modules of ``model`` that run in fp8 (torchao's ``Float8Linear``); imports nothing.

    Example:
        >>> from torch import nn
        >>> float8_layer_names(nn.Linear(16, 16))
        ()
    """
    return tuple(name for name, module in model.named_modules() if _is_float8(module))


def _is_float8(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).__module__.startswith("torchao.")
