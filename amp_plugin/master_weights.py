"""fp32 master weights for a model whose parameters are held in fp16 or bf16 (Apex's O2).

:func:`cast_model` casts a model to a half dtype in place (normalization layers kept in fp32
by default) and returns a :class:`MasterWeights`: an fp32 copy of every trainable half
parameter, made from the original fp32 values, so nothing is rounded away at the start.
:meth:`MasterWeights.attach` hands those copies to an optimizer in place of the half ones, so
the optimizer, its state and any loss scaler only ever see fp32 tensors. Per step:

1. backward writes half gradients into the model;
2. :meth:`~MasterWeights.grads_to_master` copy-casts them into the masters' ``.grad`` in one
   pass and drops the half ones (a loss scaler then unscales and checks the fp32 copies);
3. the optimizer steps the masters; a step hook copies them back into the model in one pass.

A skipped step never calls the optimizer, so master, model and optimizer state stay
bit-identical. The optimizer's ``zero_grad`` also clears the model's half gradients. Plain
torch: nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import fail
from amp_plugin.optim import unwrap_optimizer

__all__ = ["NORM_LAYERS", "MasterWeights", "cast_model", "check_half_dtype"]

#: Layers whose parameters and buffers :func:`cast_model` keeps in fp32 by default.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)

_HALF = (torch.float16, torch.bfloat16)


def check_half_dtype(call: str, dtype: object) -> torch.dtype:
    """``dtype`` if it is ``torch.float16`` or ``torch.bfloat16``; anything else raises.

    Example:
        >>> check_half_dtype("cast_model", torch.bfloat16)
        torch.bfloat16
    """
    if dtype not in _HALF:
        fail(call, f"dtype={dtype!r}", "torch.float16 or torch.bfloat16",
             "pass torch.float16 (with a loss scaler) or torch.bfloat16.", TypeError)  # fmt: skip
    return dtype  # type: ignore[return-value,unused-ignore]


class MasterWeights:
    """fp32 masters of a half model's trainable parameters; made by :func:`cast_model`.

    Attributes:
        dtype: the model's half dtype.
        names: for each master, every name its half parameter has in ``model.state_dict()``
            (tied weights have several).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> masters = cast_model(model, torch.float16)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> masters.attach(opt)
        >>> model(torch.ones(1, 2, dtype=torch.float16)).float().sum().backward()
        >>> masters.grads_to_master()
        >>> opt.step()  # steps the fp32 masters, then copies them into the fp16 model
        >>> model[0].weight.dtype, opt.param_groups[0]["params"][0].dtype
        (torch.float16, torch.float32)
    """

    def __init__(self, pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], names: dict[int, list[str]]):
        self._pairs = list(pairs)  # (half model parameter, fp32 master)
        self._master_of = {id(half): master for half, master in self._pairs}
        self._half_of = {id(master): half for half, master in self._pairs}
        self.names = {id(master): names.get(id(half), []) for half, master in self._pairs}
        self.dtype = self._pairs[0][0].dtype if self._pairs else torch.float16
        self._attached: dict[int, tuple[Optimizer, list[RemovableHandle], Any]] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def masters(self) -> Iterator[nn.Parameter]:
        """The fp32 master parameters, in the model's parameter order."""
        return (master for _, master in self._pairs)

    # -- the optimizer ---------------------------------------------------------------------------

    def attach(self, optimizer: Any) -> None:
        """Make ``optimizer`` step the fp32 masters in place of the model's half parameters.

        Its param groups (and any state it already has) are moved to the masters; a step
        post-hook copies updated masters back into the model; its ``zero_grad`` also clears the
        half gradients. Attaching twice is a no-op. Undo with :meth:`detach`.
        """
        opt = unwrap_optimizer(optimizer)  # raises for anything that is not an optimizer
        if id(opt) in self._attached:
            return
        for group in opt.param_groups:
            group["params"] = [self._master_of.get(id(p), p) for p in group["params"]]
        for half, master in self._pairs:
            if half in opt.state:
                opt.state[master] = opt.state.pop(half)
        handles = [opt.register_step_post_hook(lambda o, args, kwargs: self.master_to_model(o))]
        had_own = "zero_grad" in vars(opt)
        own = vars(opt).get("zero_grad")
        inner = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            inner(set_to_none)
            self._zero_half_grads(opt, set_to_none)

        opt.zero_grad = zero_grad
        self._attached[id(opt)] = (opt, handles, own if had_own else None)

    def detach(self, optimizer: Any | None = None) -> None:
        """Give ``optimizer`` (every attached one by default) its half parameters back."""
        attached = [opt for opt, _, _ in self._attached.values()]
        opts = [unwrap_optimizer(optimizer)] if optimizer is not None else attached
        for opt in opts:
            entry = self._attached.pop(id(opt), None)
            if entry is None:
                continue
            _, handles, own = entry
            for handle in handles:
                handle.remove()
            if own is None:
                del opt.zero_grad
            else:
                opt.zero_grad = own  # type: ignore[method-assign]
            for group in opt.param_groups:
                group["params"] = [self._half_of.get(id(p), p) for p in group["params"]]
            for master in list(opt.state):
                if id(master) in self._half_of:
                    opt.state[self._half_of[id(master)]] = opt.state.pop(master)

    def _own(self, optimizer: Any | None) -> list[tuple[nn.Parameter, nn.Parameter]]:
        if optimizer is None:
            return self._pairs
        opt = unwrap_optimizer(optimizer)
        return [
            (self._half_of[id(p)], p)
            for group in opt.param_groups
            for p in group["params"]
            if id(p) in self._half_of
        ]

    # -- the per-step copies ---------------------------------------------------------------------

    @torch.no_grad()
    def grads_to_master(self, optimizer: Any | None = None) -> None:
        """Move the model's half gradients into the masters' fp32 ``.grad``, then drop them.

        Only ``optimizer``'s parameters (all by default). A master with no gradient gets the
        cast copy; one that has one (accumulation across steps without ``zero_grad``) gets it
        added, so the sums are those of fp32 training. One foreach pass for the copies, one for the adds;
        the copies are fp32, so a loss scaler unscales them without underflow.
        """
        copy_to: list[Tensor] = []
        copy_from: list[Tensor] = []
        add_to: list[Tensor] = []
        add_from: list[Tensor] = []
        for half, master in self._own(optimizer):
            grad = half.grad
            if grad is None:
                continue
            if grad.is_sparse or (master.grad is not None and master.grad.is_sparse):
                master.grad = grad.to(master.dtype) if master.grad is None else master.grad + grad
            elif master.grad is None:
                master.grad = torch.empty_like(master, memory_format=torch.preserve_format)
                copy_to.append(master.grad)
                copy_from.append(grad)
            else:
                add_to.append(master.grad)
                add_from.append(grad)
            half.grad = None
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)  # the cast copy, one foreach pass
        if add_to:
            torch._foreach_add_(add_to, add_from)

    @torch.no_grad()
    def master_to_model(self, optimizer: Any | None = None) -> None:
        """Copy (round to nearest) the fp32 masters into the model's half parameters, one pass."""
        pairs = self._own(optimizer)
        if pairs:
            torch._foreach_copy_([h.data for h, _ in pairs], [m.data for _, m in pairs])

    def _zero_half_grads(self, optimizer: Optimizer, set_to_none: bool) -> None:
        for half, _ in self._own(optimizer):
            if half.grad is None:
                continue
            if set_to_none:
                half.grad = None
            else:
                half.grad.detach_().zero_()

    # -- checkpoints -----------------------------------------------------------------------------

    def fp32_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (the model's) with each half parameter replaced by its fp32 master.

        Such a checkpoint is an ordinary fp32 one: it loads into the fp32 model, and a resume
        through :func:`cast_model` restores the masters exactly.
        """
        out = dict(state_dict)
        masters = self._masters_by_id()
        for master_id, names in self.names.items():
            master = masters[master_id]
            for name in names:
                if name in out:
                    out[name] = master.detach().clone()
        return out

    def check_fp32_state_dict(self, state_dict: dict[str, Any]) -> list[tuple[nn.Parameter, Tensor]]:
        """Raise ``ValueError`` if a master's entry in ``state_dict`` is not a tensor of its shape.

        Returns the (master, value) pairs :meth:`load_fp32_state_dict` copies; changes nothing.
        """
        updates: list[tuple[nn.Parameter, Tensor]] = []
        masters = self._masters_by_id()
        for master_id, names in self.names.items():
            master = masters[master_id]
            value = next((state_dict[n] for n in names if n in state_dict), None)
            if value is None:
                continue
            if not isinstance(value, Tensor) or value.shape != master.shape:
                fail("MasterWeights.load_fp32_state_dict", f"{names[0]}={_describe(value)}",
                     f"a tensor of shape {tuple(master.shape)}",
                     "load a checkpoint of this model.")  # fmt: skip
            updates.append((master, value))
        return updates

    @torch.no_grad()
    def load_fp32_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy the fp32 values of ``state_dict`` into the masters and the model; a key that is
        missing leaves its master as it is. Every entry is checked before anything is copied."""
        for master, value in self.check_fp32_state_dict(state_dict):
            master.copy_(value)
            self._half_of[id(master)].copy_(value)

    def _masters_by_id(self) -> dict[int, nn.Parameter]:
        return {id(m): m for _, m in self._pairs}


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"


def _kept(module: nn.Module, keep: tuple[type[nn.Module], ...]) -> set[int]:
    """ids of every module under an instance of ``keep`` (their tensors stay as they are)."""
    kept: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, keep):
            kept.update(id(m) for m in sub.modules())
    return kept


@torch.no_grad()
def cast_model(
    module: nn.Module,
    dtype: torch.dtype,
    keep_fp32: Sequence[type[nn.Module]] = NORM_LAYERS,
    master_weights: bool = True,
) -> MasterWeights:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place; return the masters.

    Parameters keep their identity (only ``.data`` changes), so tied weights stay tied and a
    model that was already handed to an optimizer stays consistent. Submodules that are
    instances of ``keep_fp32`` (normalization layers by default; ``()`` casts everything)
    keep their tensors. fp64 tensors are left alone. With ``master_weights=False`` nothing is
    kept in fp32 beyond ``keep_fp32`` (pure half weights) and the result is empty.

    Raises:
        TypeError: ``module`` is not a module, ``dtype`` is not fp16/bf16, or ``keep_fp32`` is
            not a sequence of module classes.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> masters = cast_model(model, torch.bfloat16)
        >>> model[0].weight.dtype, model[1].weight.dtype, model[1].running_mean.dtype, len(masters)
        (torch.bfloat16, torch.float32, torch.float32, 2)
    """
    from amp_plugin.fp32_policy import check_module_classes

    if not isinstance(module, nn.Module):
        fail("cast_model", f"module={module!r:.80}", "a torch.nn.Module", "pass the model.", TypeError)
    dtype = check_half_dtype("cast_model", dtype)
    keep = check_module_classes(keep_fp32, "cast_model", "keep_fp32")
    kept = _kept(module, keep)
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    seen: set[int] = set()
    for sub in module.modules():
        if id(sub) in kept:
            continue
        for maybe in sub._parameters.values():
            if maybe is None or id(maybe) in seen or not _castable(maybe):
                continue
            param = maybe
            seen.add(id(param))
            original = param.data
            param.data = original.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
            if master_weights and param.requires_grad:
                pairs.append((param, nn.Parameter(original, requires_grad=True)))
        for key, buf in sub._buffers.items():
            if buf is not None and _castable(buf):
                sub._buffers[key] = buf.to(dtype)
    return MasterWeights(pairs, names)


def _castable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype not in (torch.float64, *_HALF)
