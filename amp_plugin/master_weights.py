"""fp32 master weights for a model whose parameters are held in fp16 or bf16 (Apex's O2).

:func:`cast_model` casts a model to a half dtype in place (normalization layers kept in fp32
by default) and returns a :class:`MasterWeights`: an fp32 copy of every trainable parameter it
casts, made from the values the model held (fp32 ones are not rounded; a model that was already
half gets fp32 copies of its half values, as in Apex's O2). While the masters exist, the model's
``state_dict()`` reports their fp32 values and its ``load_state_dict`` writes into them, so every
checkpoint of the model (full, weights-only, a user's own) holds what the optimizer steps.
:meth:`MasterWeights.attach` hands those copies to an optimizer in place of the half ones, so
the optimizer, its state and any loss scaler only ever see fp32 tensors. Per step:

1. backward writes half gradients into the model;
2. :meth:`~MasterWeights.grads_to_master` copy-casts them into the masters' ``.grad`` in one
   pass and drops the half ones (a loss scaler then unscales and checks the fp32 copies);
3. the optimizer steps the masters; a step hook copies them back into the model in one pass.

A skipped step never calls the optimizer, so master, model and optimizer state stay
bit-identical. The optimizer's ``zero_grad`` also clears the model's half gradients.

``cast_model(model, torch.bfloat16, master_weights="remainder")`` keeps the same fp32 masters
without storing them: an fp32 value is its bf16 high half plus 16 low bits, so beside each bf16
parameter ``b`` an int16 remainder ``r`` holds the rest, and the master's bits are exactly
``(bits(b) << 16) + r`` (Transformer Engine's ``store_param_remainders`` scheme). The split
rounds the high half up when the low bits are ``>= 0x8000``, so the model's weight is the master
rounded to the nearest bf16 with ties away from zero (round-to-nearest-even would need 17 bits:
65537 fp32 values round to an even bf16). The master parameters the optimizer steps keep their
identity (optimizer state stays keyed by them) but hold their fp32 values only during
``optimizer.step()``: a step pre-hook rebuilds them from ``(b, r)`` and releases ``r``, the
post-hook splits them back and releases them. Their gradients can wait for the step in bf16 too:
``grads_to_master(defer=True)`` hands each master the model's bf16 gradient as it is (the master
reads as a bf16 NaN meanwhile), and the pre-hook copies it into fp32; whatever reads gradient
values before the step then calls :meth:`~MasterWeights.fp32_grads` first. Plain torch: nothing
here imports Lightning.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NoReturn

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from amp_plugin._optim import unwrap_optimizer
from amp_plugin._sharding import has_dtensor
from amp_plugin._validation import check_module, fail
from amp_plugin.diagnostics._audit import join_names
from amp_plugin.fp32_policy import check_module_classes

__all__ = ["MasterWeights", "NormLayer", "cast_model", "masters_of"]

#: What ``master_weights=`` takes: fp32 masters (``True``), none (``False``), or bf16 plus a remainder.
MasterMode = bool | Literal["remainder"]

_TORCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
# LlamaRMSNorm, T5LayerNorm, timm's LayerNorm2d / RmsNorm / BatchNormAct2d, GroupNorm32, FrozenBatchNorm2d.
_NORM_NAME = re.compile(r"norm(act)?(\d+d?)?$", re.IGNORECASE)


class _NormLayerMeta(type):
    def __instancecheck__(cls, instance: object) -> bool:
        if isinstance(instance, _TORCH_NORMS):
            return True
        if not isinstance(instance, nn.Module) or not _NORM_NAME.search(type(instance).__name__):
            return False
        # A wrapper named like a norm layer (PreNorm, AdaLayerNorm) holds real layers: not a norm layer.
        return not any(True for child in instance.children() for _ in child.parameters())


class NormLayer(nn.Module, metaclass=_NormLayerMeta):
    """Matches every normalization layer in ``isinstance`` (and so in ``keep_fp32=``); never instantiated.

    A module is a normalization layer if it is one of torch's (``BatchNorm*``, ``InstanceNorm*``,
    ``SyncBatchNorm``, ``LayerNorm``, ``GroupNorm``, ``LocalResponseNorm``, ``RMSNorm``), or if
    its class name ends in ``Norm``, optionally followed by ``Act`` and a dimension suffix
    (``LlamaRMSNorm``, ``T5LayerNorm``, timm's ``LayerNorm2d`` and ``BatchNormAct2d``,
    ``GroupNorm32``), and no submodule of it holds parameters: its parameters are its own
    scales and shifts. A wrapper such as ``PreNorm(norm, fn)`` is not one; its norm is.

    Example:
        >>> class LlamaRMSNorm(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(4))
        >>> isinstance(LlamaRMSNorm(), NormLayer), isinstance(nn.Linear(2, 2), NormLayer)
        (True, False)
    """


#: What :func:`cast_model` keeps in fp32 by default: every normalization layer (see :class:`NormLayer`).
NORM_LAYERS: tuple[type[nn.Module], ...] = (NormLayer,)

_HALF = (torch.float16, torch.bfloat16)


def check_half_dtype(call: str, dtype: object) -> torch.dtype:
    """``dtype`` if it is ``torch.float16`` or ``torch.bfloat16``; anything else raises.

    Example:
        >>> check_half_dtype("cast_model", torch.bfloat16)
        torch.bfloat16
    """
    if dtype not in _HALF:
        fail(
            call,
            passed=f"dtype={dtype!r}",
            allowed="torch.float16 or torch.bfloat16",
            hint="pass torch.float16 (with a loss scaler) or torch.bfloat16.",
            error=TypeError,
        )
    return dtype  # type: ignore[return-value,unused-ignore]


def check_master_weights(call: str, master_weights: object, dtype: object | None = None) -> MasterMode:
    """``master_weights`` if it is ``True``, ``False`` or ``"remainder"`` (only with bf16); else raise.

    Another value raises ``TypeError`` (a string such as ``"False"`` is truthy); ``"remainder"``
    with fp16 raises ``ValueError``.

    ``dtype`` is the half dtype the model will be cast to, where it is known (``None``: not yet).

    Example:
        >>> check_master_weights("cast_model", "remainder", torch.bfloat16)
        'remainder'
        >>> check_master_weights("cast_model", "remainder", torch.float16)
        Traceback (most recent call last):
        ...
        ValueError: cast_model(master_weights='remainder' with torch.float16) is not allowed here: ...
    """
    remainder = isinstance(master_weights, str) and master_weights == "remainder"
    if not (remainder or master_weights is True or master_weights is False):
        fail(
            call,
            passed=f"master_weights={master_weights!r}",
            allowed="a bool (True or False) or 'remainder'",
            hint="pass master_weights=True for fp32 masters, or 'remainder' for bf16 plus 16-bit remainders.",
            error=TypeError,
        )
    if master_weights == "remainder" and dtype is not None and dtype != torch.bfloat16:
        fail(
            call,
            passed=f"master_weights='remainder' with {dtype}",
            why=f"an fp32 value is a bf16 value plus 16 bits, not a {dtype} value plus 16 bits",
            allowed="master_weights='remainder' with torch.bfloat16 only",
            hint=(
                "use bf16 ('bf16-mixed'), or master_weights=True for fp16: an fp16 value and 16 more bits "
                "cannot hold an fp32 master exactly (fp16 has fewer exponent bits)."
            ),
        )
    return master_weights  # type: ignore[return-value]


class MasterWeights:
    """fp32 masters of a half model's trainable parameters; made by :func:`cast_model`.

    Attributes:
        dtype: the model's half dtype.
        names: for each master, every name its half parameter has in ``model.state_dict()``
            (tied weights have several).
        remainder: the masters are held as int16 remainders beside the bf16 parameters and
            hold their fp32 values (and fp32 gradients) only from ``optimizer.step()`` on (read
            the values with :meth:`values`); ``False``: they are ordinary fp32 tensors.

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

    def __init__(
        self,
        pairs: Sequence[tuple[nn.Parameter, nn.Parameter]],
        names: dict[int, list[str]],
        remainders: Sequence[Tensor] | None = None,
    ):
        self._pairs = list(pairs)  # (half model parameter, fp32 master)
        self._master_of = {id(half): master for half, master in self._pairs}
        self._half_of = {id(master): half for half, master in self._pairs}
        self.names = {id(master): names.get(id(half), []) for half, master in self._pairs}
        self.dtype = self._pairs[0][0].dtype if self._pairs else torch.float16
        self.remainder = remainders is not None
        # Remainder mode: id(master) -> its int16 remainder while packed; None while the master is live.
        self._rest: dict[int, Tensor | None] = {}
        if remainders is not None:
            self._rest = {id(master): r for (_, master), r in zip(self._pairs, remainders, strict=True)}
        self._attached: dict[int, tuple[Optimizer, list[RemovableHandle], Any]] = {}
        self._module_hooks: list[RemovableHandle] = []
        self._nans: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # the packed masters' stand-ins
        self._lent: set[int] = set()  # id(master) whose fp32 .grad the step pre-hook copied from bf16

    def __getstate__(self) -> dict[str, Any]:
        # A deep copy or pickle of the model copies its masters through the state_dict hooks; the
        # id-keyed tables are rebuilt for the copies, and a copy is attached to no optimizer.
        names = [self.names[id(master)] for _, master in self._pairs]
        rest = [self._rest[id(master)] for _, master in self._pairs] if self.remainder else None
        return {"pairs": self._pairs, "names": names, "hooks": self._module_hooks, "remainders": rest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pairs = state["pairs"]
        names = {id(half): names for (half, _), names in zip(pairs, state["names"], strict=True)}
        rest = state.get("remainders")
        self.__init__(pairs, names, None if rest is None else [torch.empty(0) for _ in pairs])  # type: ignore[misc]
        if rest is not None:  # a master that was live when copied stays live (its remainder is None)
            self._rest = {id(master): r for (_, master), r in zip(pairs, rest, strict=True)}
        self._module_hooks = state["hooks"]

    def master_of(self, param: Tensor) -> nn.Parameter | None:
        """The fp32 master of the model parameter ``param``, ``None`` if it has none."""
        return self._master_of.get(id(param))

    def value_of(self, param: Tensor) -> Tensor | None:
        """The fp32 master value of the model parameter ``param`` (a rebuilt copy with remainders)."""
        master = self._master_of.get(id(param))
        return None if master is None else self._value(self._half_of[id(master)], master)

    def __len__(self) -> int:
        return len(self._pairs)

    def masters(self) -> Iterator[nn.Parameter]:
        """The fp32 master parameters, in the model's parameter order.

        With remainders their values exist only during ``optimizer.step()`` (outside it they read
        as NaN, bf16 while they carry a bf16 gradient to the step, and cannot be written);
        :meth:`values` gives the values at any time.
        """
        return (master for _, master in self._pairs)

    def remainders(self) -> list[Tensor]:
        """The int16 remainders that hold the masters' low bits (empty without remainders).

        A master that is live (inside ``optimizer.step()``) has none: its fp32 tensor holds the value.
        """
        return [rest for rest in self._rest.values() if rest is not None]

    @torch.no_grad()
    def values(self) -> list[Tensor]:
        """The fp32 master values, in the model's parameter order (remainders: rebuilt copies).

        Example:
            >>> model = nn.Linear(2, 1)
            >>> masters = cast_model(model, torch.bfloat16, master_weights="remainder")
            >>> torch.equal(masters.values()[0], model.state_dict()["weight"])
            True
        """
        return [self._value(half, master) for half, master in self._pairs]

    def _value(self, half: Tensor, master: Tensor) -> Tensor:
        rest = self._rest.get(id(master)) if self.remainder else None
        if rest is None:
            return master.detach()
        value = torch.empty_like(half, dtype=torch.float32)
        _join_all([value], [half], [rest])
        return value

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
        self._follow_devices()
        handles = [opt.register_step_post_hook(lambda o, args, kwargs: self.master_to_model(o))]
        if self.remainder:
            handles.insert(0, opt.register_step_pre_hook(lambda o, args, kwargs: self._unpack(self._own(o))))
            # torch's load_state_dict casts the state to its parameter's dtype: fp32 masters then.
            handles.append(opt.register_load_state_dict_pre_hook(lambda o, state: self.fp32_grads(o)))
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
    def grads_to_master(self, optimizer: Any | None = None, *, defer: bool = False) -> None:
        """Move the model's half gradients into the masters' fp32 ``.grad``, then drop them.

        Only ``optimizer``'s parameters (all by default). A master with no gradient gets the
        cast copy; one that has one (accumulation across steps without ``zero_grad``) gets it
        added, so the sums are those of fp32 training. One foreach pass for the copies, one for the adds;
        the copies are fp32, so a loss scaler unscales them without underflow.

        ``defer=True`` (remainders only; ``AMPPrecision`` passes it): a master without a gradient
        takes the bf16 one as it is (no pass), so no fp32 gradient exists as ``optimizer.step()``
        is called; the step's pre-hook makes the fp32 copy. Whatever reads or changes gradient
        values before the step must call :meth:`fp32_grads` first (a clip would otherwise act
        on bf16 gradients); the inf/NaN check needs no such call.
        """
        pairs = self._own(optimizer)
        if self.remainder:  # fp32 masters for eager copies, and for adds to a gradient waiting in bf16
            eager = [(h, m) for h, m in pairs if h.grad is not None and (not defer or m.grad is not None)]
            self._fp32_grads(eager)
        copy_to: list[Tensor] = []
        copy_from: list[Tensor] = []
        add_to: list[Tensor] = []
        add_from: list[Tensor] = []
        for half, master in pairs:
            grad = half.grad
            if grad is None:
                continue
            if grad.is_sparse or (master.grad is not None and master.grad.is_sparse):
                master.grad = grad.to(torch.float32) if master.grad is None else master.grad + grad
            elif defer and master.grad is None and self.remainder and self._rest[id(master)] is not None:
                # Packed: the bf16 gradient waits as it is (its master a bf16 stand-in meanwhile);
                # the step's pre-hook makes the fp32 copy, so none exists as step() is called.
                master.data = _stand_in(half, self._nans, grad.dtype)
                master.grad = grad
            elif master.grad is None:
                like = half if self.remainder else master  # a packed master's own data is a stand-in
                master.grad = torch.empty_like(like, dtype=torch.float32, memory_format=torch.preserve_format)
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
    def fp32_grads(self, optimizer: Any | None = None) -> None:
        """Give each gradient that waits in bf16 its exact fp32 copy now (remainders only; else a no-op).

        With remainders, ``grads_to_master(defer=True)`` hands ``optimizer``'s masters the model's
        bf16 gradients as they are, and the step's pre-hook copies them into fp32 (so that no fp32
        gradient exists as ``optimizer.step()`` is called). Whatever reads or changes gradient
        values before the step (a clip, a hook, a norm) calls this first and sees what O2 gives it:
        fp32 gradients, the clip's multiply rounded in fp32. One foreach pass.
        """
        if self.remainder:
            self._fp32_grads(self._own(optimizer))

    def _fp32_grads(self, pairs: list[_Pair]) -> list[nn.Parameter]:
        """:meth:`fp32_grads` for ``pairs``: a bf16 stand-in master becomes fp32, its gradient an fp32 copy.

        Returns the masters whose gradient was copied (one foreach pass for them all).
        """
        waiting = [(half, master) for half, master in pairs if master.dtype != torch.float32]
        grads = [master.grad for _, master in waiting]
        for half, master in waiting:
            master.grad = None
            master.data = _stand_in(half, self._nans)
        pending = [(m, g) for (_, m), g in zip(waiting, grads, strict=True) if g is not None]
        copies = [torch.empty_like(grad, dtype=torch.float32) for _, grad in pending]
        if copies:
            torch._foreach_copy_(copies, [grad for _, grad in pending])
        for (master, _), copy in zip(pending, copies, strict=True):
            master.grad = copy
        return [master for master, _ in pending]

    @torch.no_grad()
    def master_to_model(self, optimizer: Any | None = None) -> None:
        """Copy (round to nearest) the fp32 masters into the model's half parameters, one pass.

        With remainders: split each live master into its bf16 parameter and remainder, exactly,
        and release the master's fp32 storage.
        """
        pairs = self._own(optimizer)
        if self.remainder:
            self._pack(pairs)
        elif pairs:
            torch._foreach_copy_([h.data for h, _ in pairs], [m.data for _, m in pairs])

    def _unpack(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """Give each packed master its fp32 value, ``(bits(b) << 16) + r``; release ``r``.

        A chunk of at most :data:`_CHUNK_BYTES` of fp32 values at a time (foreach passes over the
        chunk's tensors), so that the step's peak holds one chunk's remainders beside the masters
        at most. A master that is live already (a step that raised half-way) keeps its values.
        """
        with torch.no_grad():
            packed = [(half, master) for half, master in pairs if self._rest[id(master)] is not None]
            for chunk in _chunks(packed):
                highs = [half.data for half, _ in chunk]
                values = [torch.empty_like(high, dtype=torch.float32) for high in highs]
                _join_all(values, highs, [rest for _, m in chunk if (rest := self._rest[id(m)]) is not None])
                # The gradients that waited in bf16 get their fp32 copies; they go back at _pack.
                self._lent.update(id(master) for master in self._fp32_grads(chunk))
                for (_, master), value in zip(chunk, values, strict=True):
                    master.data = value
                    self._rest[id(master)] = None

    def _pack(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """Split each live master into its bf16 parameter and a new remainder; release the master.

        A chunk at a time, as :meth:`_unpack` rebuilds them. A gradient the pre-hook copied from
        bf16 goes back to bf16 (its master a bf16 stand-in again until ``zero_grad``): exact, as
        the step only reads it (an optimizer that wrote into it would see its write rounded).
        """
        with torch.no_grad():
            live = [(half, master) for half, master in pairs if self._rest[id(master)] is None]
            for chunk in _chunks(live):
                highs = [half.data for half, _ in chunk]
                rests = [torch.empty_like(high, dtype=torch.int16) for high in highs]
                _split_all(highs, rests, [master.data for _, master in chunk])
                lent = [(h, m, g) for h, m in chunk if id(m) in self._lent and (g := m.grad) is not None]
                back = [torch.empty_like(g, dtype=h.dtype) for h, _, g in lent]
                if back:
                    torch._foreach_copy_(back, [g for _, _, g in lent])
                for (half, master), rest in zip(chunk, rests, strict=True):
                    self._rest[id(master)] = rest
                    self._lent.discard(id(master))
                    master.data = _stand_in(half, self._nans)
                for (half, master, _), grad in zip(lent, back, strict=True):
                    master.grad = None
                    master.data = _stand_in(half, self._nans, grad.dtype)
                    master.grad = grad

    @torch.no_grad()
    def _follow_devices(self) -> None:
        """Move masters (or remainders) that are not on their parameter's device to it.

        Lightning's strategies cast the model, then move it; the optimizer is attached after
        that, so the masters, their gradients and the optimizer state live where the model does.
        """
        for half, master in self._pairs:
            if master.device == half.device:
                continue
            rest = self._rest.get(id(master))
            if rest is not None:
                self._rest[id(master)] = rest.to(half.device)
                master.data = _stand_in(half, self._nans, master.dtype)  # bf16 while it carries a bf16 grad
            else:
                master.data = master.data.to(half.device)

    def _zero_half_grads(self, optimizer: Optimizer, set_to_none: bool) -> None:
        pairs = self._own(optimizer)
        if self.remainder:  # a master whose bf16 gradient was dropped takes its fp32 stand-in back
            self._fp32_grads([(h, m) for h, m in pairs if m.grad is None])
        for half, _ in pairs:
            if half.grad is None:
                continue
            if set_to_none:
                half.grad = None
            else:
                half.grad.detach_().zero_()

    # -- the model's state_dict ------------------------------------------------------------------

    def hook(self, module: nn.Module) -> None:
        """Make ``module.state_dict()`` report the fp32 masters and ``load_state_dict`` fill them.

        :func:`cast_model` calls this on the module it cast, so a checkpoint of the model (full or
        weights-only, Lightning's or a user's own) holds the fp32 values, an ordinary fp32
        ``state_dict``. Loading one checks the masters' entries first (``ValueError``, nothing
        changed), then copies them into the masters; torch copies them (rounded) into the half
        parameters. Undo with :meth:`unhook`.
        """
        self.unhook()
        hooks = _ModuleHooks(self)
        self._module_hooks = [
            module.register_state_dict_post_hook(hooks),
            module.register_load_state_dict_pre_hook(hooks.load),
        ]

    def unhook(self) -> None:
        """Undo :meth:`hook`: the module's ``state_dict`` reports its half parameters again."""
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []

    def check_fp32_state_dict(
        self, state_dict: dict[str, Any], prefix: str = ""
    ) -> list[tuple[nn.Parameter, Tensor]]:
        """Raise ``ValueError`` if a master's entry in ``state_dict`` is not a tensor of its shape.

        Returns the (master, value) pairs a load copies; changes nothing. A missing entry is left
        out (``load_state_dict`` reports missing keys itself).
        """
        updates: list[tuple[nn.Parameter, Tensor]] = []
        for _, master in self._pairs:
            names = self.names[id(master)]
            value = next((state_dict[prefix + n] for n in names if prefix + n in state_dict), None)
            if value is None:
                continue
            if not isinstance(value, Tensor) or value.shape != master.shape:
                fail(
                    "MasterWeights.load_state_dict",
                    passed=f"{prefix}{names[0]}={_describe(value)}",
                    why="it does not fit this model's parameter",
                    allowed=f"a tensor of shape {tuple(master.shape)}",
                    hint="load a checkpoint of this model.",
                )
            updates.append((master, value))
        return updates

    @torch.no_grad()
    def _report(self, state_dict: dict[str, Any], prefix: str) -> None:
        for half, master in self._pairs:
            keys = [prefix + name for name in self.names[id(master)] if prefix + name in state_dict]
            if not keys:
                continue
            if self.remainder:  # no live tensor holds the value: a rebuilt copy, even for keep_vars=True
                value = self._value(half, master)
                for key in keys:
                    state_dict[key] = value
                continue
            for key in keys:  # a Parameter there means state_dict(keep_vars=True)
                state_dict[key] = master if isinstance(state_dict[key], nn.Parameter) else master.detach()

    @torch.no_grad()
    def _load(self, state_dict: dict[str, Any], prefix: str) -> None:
        updates = self.check_fp32_state_dict(state_dict, prefix)
        if not self.remainder:
            for master, value in updates:
                master.copy_(value)
            return
        for master, value in updates:
            half = self._half_of[id(master)]
            fp32 = value.detach().to(device=half.device, dtype=torch.float32)
            if self._rest[id(master)] is None:  # live (loaded from inside a step): the master takes it
                master.copy_(fp32)
                continue
            rest = torch.empty_like(half.data, dtype=torch.int16)
            high = torch.empty_like(half.data)
            _split_all([high], [rest], [fp32.clone()])
            self._rest[id(master)] = rest
            # torch's own load then copies this bf16 high half (not a round-to-nearest-even) in.
            for name in self.names[id(master)]:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = high


class _ModuleHooks:
    """The state_dict hooks :meth:`MasterWeights.hook` registers (an object, so a deep copy of
    the model gets hooks that report the copy's own masters)."""

    def __init__(self, masters: MasterWeights) -> None:
        self.masters = masters

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        self.masters._report(state_dict, prefix)

    def load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        self.masters._load(state_dict, prefix)


def masters_of(module: nn.Module) -> MasterWeights | None:
    """The :class:`MasterWeights` whose fp32 values ``module.state_dict()`` reports, if any.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> masters_of(model) is None
        True
        >>> masters = cast_model(model, torch.float16)
        >>> masters_of(model) is masters
        True
    """
    check_module("masters_of", "module", module)
    found = None
    for hook in module._state_dict_hooks.values():  # the latest registration is the one that reports
        if isinstance(hook, _ModuleHooks):
            found = hook.masters
    return found


#: fp32 bytes of masters rebuilt (or split) together: the step's transient above 18 B/param is
#: one chunk's remainders (or, while splitting, its new remainders), not the whole model's.
_CHUNK_BYTES = 1 << 26
_Pair = tuple[nn.Parameter, nn.Parameter]  # (half model parameter, fp32 master)


def _chunks(pairs: list[_Pair]) -> Iterator[list[_Pair]]:
    """``pairs`` in consecutive chunks of at most :data:`_CHUNK_BYTES` of fp32 (a larger tensor alone)."""
    chunk: list[_Pair] = []
    size = 0
    for pair in pairs:
        nbytes = 4 * pair[0].numel()
        if chunk and size + nbytes > _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(pair)
        size += nbytes
    if chunk:
        yield chunk


def _join_all(outs: list[Tensor], highs: list[Tensor], rests: list[Tensor]) -> None:
    """Each ``out`` (fp32) = the value whose bits are ``(bits(high) << 16) + rest``, in int32 arithmetic.

    ``high`` is bf16, ``rest`` int16 (the low 16 bits as a signed number); any strides. Two
    foreach passes over the lists.
    """
    bits = [out.view(torch.int32) for out in outs]
    torch._foreach_copy_(bits, rests)  # sign-extended: a negative remainder borrows from the high half
    # |bits(high) * 2**16| <= 2**31: fits.
    torch._foreach_add_(bits, [high.view(torch.int16) for high in highs], alpha=1 << 16)


def _split_all(highs: list[Tensor], rests: list[Tensor], values: list[Tensor]) -> None:
    """Write each fp32 ``value`` as bf16 ``high`` and int16 ``rest`` so that :func:`_join_all` restores it.

    ``high`` takes the top 16 bits, plus one when the low 16 bits are ``>= 0x8000`` (the value
    rounded to the nearest bf16, ties away from zero: adding one to the bits of a sign-magnitude
    number moves it away from zero); ``rest`` takes the low 16 bits as a signed number, which is
    the low half minus ``0x10000`` exactly in that case. ``values`` are overwritten (they are the
    masters being released). Four integer passes in place (three of them foreach), each over one
    dtype pair: the int32 -> int16 copies keep the low 16 bits (two's complement narrowing), and
    no temporary is allocated.
    """
    bits = [value.view(torch.int32) for value in values]
    torch._foreach_copy_(rests, bits)  # the signed low half
    torch._foreach_add_(bits, 1 << 15)  # the carry into the high half when the low half is >= 0x8000
    for b in bits:  # torch has no foreach shift
        b.bitwise_right_shift_(16)  # arithmetic shift: the bf16 bits, as a signed number
    torch._foreach_copy_([high.view(torch.int16) for high in highs], bits)
    # Only a NaN whose top 16 bits are all ones (0x7FFF/0xFFFF) and low half >= 0x8000 wraps; the
    # join still restores its bits, but the bf16 weight shows a zero instead of NaN.


def _stand_in(
    half: Tensor,
    nans: dict[tuple[torch.device, torch.dtype], Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """What a packed master holds: one NaN broadcast to its shape (reads show NaN, writes raise).

    fp32; bf16 while the master carries the model's bf16 gradient, waiting for the step. ``nans``
    caches one 0-dim NaN per device and dtype for the stand-ins of one :class:`MasterWeights`, so
    packing its masters launches no fill per tensor per step.
    """
    key = (half.device, dtype)
    nan = None if nans is None else nans.get(key)
    if nan is None:
        nan = torch.full((), float("nan"), dtype=dtype, device=half.device)
        if nans is not None:
            nans[key] = nan
    return nan.expand(half.shape)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"


def _kept(module: nn.Module, keep: tuple[type[nn.Module], ...]) -> set[int]:
    """ids of every module under an instance of ``keep`` (their tensors are held in fp32)."""
    kept: set[int] = set()
    for sub in module.modules():
        if id(sub) not in kept and isinstance(sub, keep):
            kept.update(id(m) for m in sub.modules())
    return kept


@torch.no_grad()
def cast_model(
    module: nn.Module,
    dtype: torch.dtype,
    keep_fp32: Sequence[type[nn.Module]] = NORM_LAYERS,
    master_weights: MasterMode = True,
) -> MasterWeights:
    """Cast ``module``'s floating parameters and persistent buffers to ``dtype`` in place; return the masters.

    Parameters keep their identity (only ``.data`` changes), so tied weights stay tied and a
    model that was already handed to an optimizer stays consistent. Every trainable parameter
    that is cast gets an fp32 master: a copy of its fp32 values, or of its half values if the
    model was half already, or the values of the masters an earlier ``cast_model`` of the same
    model made (those are retired). Frozen parameters (``requires_grad=False``) are cast
    without a master. Submodules that are instances of ``keep_fp32`` (normalization layers by
    default, see :class:`NormLayer`; ``()`` casts everything) hold fp32 tensors: half ones are
    cast up. fp64 tensors and non-persistent buffers (precomputed tables such as rotary
    ``inv_freq``, which are not in the ``state_dict``) are left as they are. With
    ``master_weights=False`` the result is empty (pure half weights). With masters,
    ``module.state_dict()`` reports them from now on (:meth:`MasterWeights.hook`).
    ``master_weights="remainder"`` (bf16 only) keeps each master as the bf16 parameter plus an
    int16 remainder (see the module docs): the parameter is the master rounded to nearest with
    ties away from zero, and the master itself holds its fp32 values only during a step.

    Raises:
        TypeError: ``module`` is not a module, ``dtype`` is not fp16/bf16, or ``keep_fp32`` is
            not a sequence of module classes.
        ValueError: ``master_weights`` is not ``True``, ``False`` or ``"remainder"``, or
            ``"remainder"`` comes with fp16.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> masters = cast_model(model, torch.bfloat16)
        >>> model[0].weight.dtype, model[1].weight.dtype, model[1].running_mean.dtype, len(masters)
        (torch.bfloat16, torch.float32, torch.float32, 2)
        >>> model.state_dict()["0.weight"].dtype  # the fp32 master
        torch.float32
    """
    if not isinstance(module, nn.Module):
        fail(
            "cast_model",
            passed=f"module={module!r:.80}",
            allowed="a torch.nn.Module",
            hint="pass the model.",
            error=TypeError,
        )
    dtype = check_half_dtype("cast_model", dtype)
    remainder = check_master_weights("cast_model", master_weights, dtype) == "remainder"
    keep = check_module_classes(keep_fp32, "cast_model", "keep_fp32")
    kept = _kept(module, keep)
    if sharded := _sharded_casts(module, kept, dtype, master_weights is not False):
        refuse_sharded("cast_model", sharded)
    previous = masters_of(module)
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    remainders: list[Tensor] = []
    seen: set[int] = set()
    for sub in module.modules():
        target = torch.float32 if id(sub) in kept else dtype
        for maybe in sub._parameters.values():
            if maybe is None or id(maybe) in seen or not _castable(maybe):
                continue
            param = maybe
            seen.add(id(param))
            original = previous.value_of(param) if previous is not None else None
            original = original if original is not None else param.data
            mastered = master_weights is not False and param.requires_grad and target != torch.float32
            if mastered and remainder:
                high = torch.empty_like(original, dtype=target)
                remainders.append(torch.empty_like(original, dtype=torch.int16))
                _split_all([high], [remainders[-1]], [original.float().clone()])
                _cast_(param, high, target)
                pairs.append((param, nn.Parameter(_stand_in(high), requires_grad=True)))
                continue
            _cast_(param, original, target)
            if mastered:
                pairs.append((param, nn.Parameter(original.float(), requires_grad=True)))
        for key, buf in sub._buffers.items():
            if buf is not None and _castable(buf) and key not in sub._non_persistent_buffers_set:
                sub._buffers[key] = buf.to(target)
    if previous is not None:
        previous.detach()
        previous.unhook()
    masters = MasterWeights(pairs, names, remainders if remainder else None)
    if pairs:
        masters.hook(module)
    return masters


def refuse_sharded(call: str, names: Sequence[str]) -> NoReturn:
    """Raise the ``ValueError`` for half weights or masters of parameters already sharded (DTensors)."""
    fail(
        call,
        passed=f"a module whose parameters are sharded DTensors already ({join_names(list(names))})",
        why=(
            "fully_shard (FSDP2) or tensor parallelism owns their sharded storage: a cast of .data does "
            "not reach it, and fp32 masters of DTensors are not supported"
        ),
        allowed="plain parameters, or DTensor ones in the dtype they would be cast to, without masters",
        hint=(
            "keep the model fp32 and shard it with fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) under AMPPrecision('bf16-mixed'): "
            "the fp32 shards are the master weights. For half weights, cast before sharding "
            "(self.to(torch.bfloat16) in configure_model, before fully_shard) and leave master_weights off."
        ),
    )


def _sharded_casts(module: nn.Module, kept: set[int], dtype: torch.dtype, masters: bool) -> list[str]:
    """Names of the DTensor parameters :func:`cast_model` would cast or give a master (it cannot)."""
    found: list[str] = []
    if not has_dtensor(list(module.parameters())):
        return found
    for prefix, sub in module.named_modules():
        target = torch.float32 if id(sub) in kept else dtype
        for name, param in sub._parameters.items():
            if param is None or not has_dtensor([param]) or not _castable(param):
                continue
            if param.dtype != target or (masters and param.requires_grad and target != torch.float32):
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def _cast_(param: nn.Parameter, values: Tensor, dtype: torch.dtype) -> None:
    if param.dtype != dtype or values is not param.data:
        param.data = values.to(dtype)
        if param.grad is not None and param.grad.dtype != dtype:
            param.grad = param.grad.to(dtype)


def _castable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64
