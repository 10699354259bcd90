"""fp32 gradient accumulation for a model whose parameters are held in fp16 or bf16.

With gradient accumulation, torch adds each micro-batch's gradient into the parameter's ``.grad``
in the parameter's dtype: in bf16 every addition rounds to 8 significant bits (fp16: 11), so a
micro-batch gradient much smaller than the running sum is lost. :class:`Fp32GradAccumulation`
moves each half gradient into an fp32 sum as soon as backward has written it (a
``register_post_accumulate_grad_hook`` per parameter) and clears the half ``.grad``, so the sum is
rounded at most once. :meth:`~Fp32GradAccumulation.flush_` hands the sums to the step: into an
fp32 master's ``.grad`` as they are, or into the half ``.grad`` rounded once; then they are freed.

Memory: 4 bytes per trainable half parameter between the first backward of a step and its
flush (the half ``.grad`` lives only inside each backward). Plain torch: nothing here imports
Lightning.

Under ``DistributedDataParallel``, :meth:`~Fp32GradAccumulation.reduce_across` makes DDP average
the fp32 sums at the backward that synchronises (the last micro-batch, outside ``no_sync``)
instead of the half ``.grad``, which holds nothing by then: a comm hook all-reduces each
bucket's sums as one fp32 buffer (4 bytes per parameter on the wire, where DDP alone sends 2) and
hands DDP a zeroed bucket, so the ``.grad`` DDP writes back adds nothing to the sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from amp_plugin._validation import fail

__all__ = ["Fp32GradAccumulation"]

_HALF = (torch.float16, torch.bfloat16)


class Fp32GradAccumulation:
    """Add the half gradients of ``params`` up in fp32 until :meth:`flush_`.

    Args:
        params: the parameters to accumulate; only trainable fp16/bf16 ones are hooked (fp32
            ones already add up in fp32).

    Example:
        >>> w = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> acc = Fp32GradAccumulation([w])
        >>> for g in [1.0] + [2.0**-10] * 8:
        ...     (w * g).sum().backward()
        >>> w.grad is None, acc.pending()
        (True, 1)
        >>> acc.flush_([(w, w)])  # rounded once into the bf16 .grad
        >>> w.grad.item()  # 1 + 8 * 2**-10; adding up in the bf16 .grad would have stayed at 1.0
        1.0078125
        >>> acc.remove()
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        checked = _checked_params(params)
        self._sums: dict[int, Tensor] = {}
        self._handles: list[RemovableHandle] = []
        self._hooked: set[int] = set()
        for param in checked:  # a generator is consumed once, by the check
            if id(param) in self._hooked or not param.requires_grad or param.dtype not in _HALF:
                continue
            self._hooked.add(id(param))
            self._handles.append(param.register_post_accumulate_grad_hook(self._take))

    def __len__(self) -> int:
        """How many parameters are hooked."""
        return len(self._handles)

    def pending(self) -> int:
        """How many fp32 sums are held now (each frees at :meth:`flush_` or :meth:`clear`)."""
        return len(self._sums)

    def _take(self, param: Tensor) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): keep the sums out of autograd
            with torch.no_grad():
                self._add(param)
        else:  # a plain backward runs its hooks with grad mode off: no context (~13 us a call) needed
            self._add(param)

    def _add(self, param: Tensor) -> None:
        grad = param.grad
        if grad is None or grad.is_sparse:  # sparse gradients keep torch's own accumulation
            return
        total = self._sums.get(id(param))
        if total is None:
            self._sums[id(param)] = grad.float()  # a new fp32 tensor (a cast copy)
        else:
            total.add_(grad)  # fp32 += half: computed in fp32, rounded once to fp32
        param.grad = None  # the next micro-batch's gradient is assigned, not added in half

    @torch.no_grad()
    def flush_(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
        """For each ``(param, target)``, add ``param``'s fp32 sum into ``target.grad``; free it.

        ``target`` is ``param`` itself (the sum is rounded once into its half ``.grad``) or its fp32
        master (the sum becomes the master's ``.grad`` with no copy). A gradient already in
        ``target.grad`` (written with the hooks off) is added to the sum. Parameters without a
        sum are left as they are.
        """
        for param, target in pairs:
            total = self._sums.pop(id(param), None)
            if total is None:
                continue
            if target.grad is not None:
                total.add_(target.grad)
            target.grad = total if target.dtype == torch.float32 else total.to(target.dtype)

    def clear(self) -> None:
        """Drop every fp32 sum (what ``zero_grad`` does to gradients)."""
        self._sums.clear()

    def reduce_across(self, ddp: Any) -> None:
        """Have ``ddp`` (a ``DistributedDataParallel``) average the fp32 sums instead of the half ``.grad``.

        Registers DDP's communication hook, so call it before the first backward, once per DDP
        model, and not with ``gradient_as_bucket_view=True`` (the ``.grad`` is then DDP's bucket).
        Parameters without an fp32 sum (fp32 ones, sparse gradients) are averaged as DDP does; a
        hooked one that got no gradient on this rank (a branch only other ranks took) sends zeros.

        Raises:
            RuntimeError: ``ddp`` has a communication hook already (DDP takes one).
        """
        ddp.register_comm_hook((self, ddp.process_group), _average_sums)

    def remove(self) -> None:
        """Unhook every parameter and drop the sums: gradients add up in ``.grad`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._sums.clear()


def _average_sums(
    state: tuple[Fp32GradAccumulation, Any], bucket: Any
) -> torch.futures.Future[Tensor]:
    """DDP's comm hook: average the bucket's fp32 sums across ranks; the rest of the bucket as DDP does."""
    accumulation, group = state
    world = dist.get_world_size(group)
    buffer: Tensor = bucket.buffer()
    grads: list[Tensor] = bucket.gradients()
    sums, plain = [], False
    for param, grad in zip(bucket.parameters(), grads, strict=True):
        if id(param) not in accumulation._hooked or grad.is_sparse:
            plain = True
            continue
        # A hooked parameter without a sum (no gradient on this rank yet: a branch another rank
        # took) still sends its zeros, so that every rank's buffer has the same layout.
        total = accumulation._sums.setdefault(id(param), torch.zeros_like(param, dtype=torch.float32))
        sums.append(total)
        grad.zero_()  # a view of the bucket: the .grad DDP writes back adds nothing to the sum
    pending: list[torch.futures.Future[Any]] = []
    if sums:
        flat = torch.cat([total.view(-1) for total in sums]).div_(world)
        pending.append(dist.all_reduce(flat, group=group, async_op=True).get_future())
    if plain:
        pending.append(dist.all_reduce(buffer.div_(world), group=group, async_op=True).get_future())

    def done(_: Any) -> Tensor:  # runs once every all-reduce has finished
        offset = 0
        for total in sums:
            total.copy_(flat[offset : offset + total.numel()].view_as(total))
            offset += total.numel()
        return buffer

    return torch.futures.collect_all(pending).then(done)


if dist.is_available():  # DDP checks a comm hook's annotations at run time; postponed ones are strings
    _average_sums.__annotations__.update(
        {"bucket": getattr(dist, "GradBucket"), "return": torch.futures.Future[Tensor]}  # noqa: B009
    )


def _checked_params(params: object) -> list[Tensor]:
    """``params`` as a list of tensors; anything else refused (``TypeError``) before a hook is made."""
    call, hint = "Fp32GradAccumulation", "pass model.parameters() (or a list of the ones to accumulate)."
    allowed, passed = "an iterable of parameters (tensors)", f"params={type(params).__name__}"
    if isinstance(params, nn.Module):
        why = "it is a module, not its parameters"
        fail(call, passed=passed, why=why, allowed=allowed, hint=hint, error=TypeError)
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        fail(call, passed=passed, allowed=allowed, hint=hint, error=TypeError)
    checked = list(params)
    stray = next((p for p in checked if not isinstance(p, Tensor)), None)
    if stray is not None:
        passed = f"params=[..., {type(stray).__name__}]"
        fail(call, passed=passed, allowed=allowed, hint=hint, error=TypeError)
    return checked
