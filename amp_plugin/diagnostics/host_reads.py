"""Count host reads: every time a tensor's value is read back to Python (``.item()``, ``bool(t)``).

On a GPU each such read waits for the device to finish all queued work, so a training step
that reads often cannot run ahead of the device. Under a :class:`HostReads` mode every read
is counted: ``aten._local_scalar_dense`` is the one op behind all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]


class HostReads(TorchDispatchMode):
    """A dispatch mode that counts host reads of tensor values in ``count`` while it is entered.

    Example:
        >>> flag = torch.tensor(1.0)
        >>> with HostReads() as reads:
        ...     _ = flag * 2  # stays a tensor: no read
        ...     _ = bool(flag > 0)  # read on the host
        >>> reads.count
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
