"""Count host reads: every time a tensor's value is read back to Python (``.item()``, ``bool(t)``).

On a GPU each read of a value on the GPU waits for the device to finish all queued work, so a
training step that reads often cannot run ahead of the device; a read of a CPU tensor (a copy
that already arrived in pinned memory, say) waits for nothing. Under a :class:`HostReads` mode
every read is counted, or with ``device="cuda"`` only the reads of values on that kind of
device: ``aten._local_scalar_dense`` is the one op behind all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]


class HostReads(TorchDispatchMode):
    """A dispatch mode that counts host reads of tensor values in ``count`` while it is entered.

    Args:
        device: count only the reads of tensors on this kind of device (``"cuda"``: the reads
            that wait for a GPU); ``None`` counts every read.

    Example:
        >>> flag = torch.tensor(1.0)
        >>> with HostReads() as reads:
        ...     _ = flag * 2  # stays a tensor: no read
        ...     _ = bool(flag > 0)  # read on the host
        >>> reads.count
        1
        >>> with HostReads("cuda") as reads:  # only reads that wait for a GPU
        ...     _ = bool(flag > 0)  # a CPU value: not counted
        >>> reads.count
        0
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += self.device is None or args[0].device.type == self.device
        return func(*args, **(kwargs or {}))
