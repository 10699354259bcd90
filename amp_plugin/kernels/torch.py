"""Reference backend: torch's own fused multi-tensor ops, on CPU and CUDA.

Every launch is per ``(device, dtype)`` group, zero-numel tensors are skipped, and no
operation reads a value back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_plugin.kernels.base import group_by_device_and_dtype

__all__ = ["TorchKernels"]


class TorchKernels:
    """Multi-tensor kernels built on ``torch._foreach_*`` and the AMP unscale op.

    Example:
        >>> import torch
        >>> from amp_plugin.kernels import get_kernels
        >>> k = get_kernels("torch")
        >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
        >>> found_inf = torch.zeros(())
        >>> k.unscale_(grads, torch.tensor(0.5), found_inf)
        >>> grads[0].tolist(), found_inf.item()
        ([1.0, 2.0], 1.0)
    """

    name = "torch"

    def unscale_(self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
        with torch.no_grad():
            for (device, _), group in group_by_device_and_dtype(tensors).items():
                if device == found_inf.device:
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale.to(device))
                else:
                    local = torch.zeros((), dtype=torch.float32, device=device)
                    torch._amp_foreach_non_finite_check_and_unscale_(group, local, inv_scale.to(device))
                    torch.maximum(found_inf, _to(local, found_inf.device), out=found_inf)

    def norm(self, tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
        groups = group_by_device_and_dtype(tensors)
        if not groups:
            return torch.zeros((), dtype=torch.float32)
        first = next(iter(groups))[0]
        with torch.no_grad():
            partial = [
                _to(
                    torch.linalg.vector_norm(
                        torch.stack(torch._foreach_norm(g, norm_type, dtype=torch.float32)), norm_type
                    ),
                    first,
                )
                for g in groups.values()
            ]
            if len(partial) == 1:
                return partial[0]
            total: Tensor = torch.linalg.vector_norm(torch.stack(partial), norm_type)
            return total

    def mul_(self, tensors: Sequence[Tensor], factor: Tensor) -> None:
        with torch.no_grad():
            for (device, _), group in group_by_device_and_dtype(tensors).items():
                torch._foreach_mul_(group, _to(factor, device))

    def unscale_norm_(
        self, tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor, norm_type: float = 2.0
    ) -> Tensor:
        self.unscale_(tensors, inv_scale, found_inf)
        return self.norm(tensors, norm_type)


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    """Copy across devices without a host sync where that is safe.

    A non-blocking copy into CPU memory may still be in flight when the host reads it next,
    so only copies onto an accelerator are made non-blocking.
    """
    return tensor.to(device, non_blocking=device.type != "cpu")
