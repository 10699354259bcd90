"""Count the aten ops a piece of code runs: what a step does, seen from outside the plugin."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# The pass that unscales the gradients (and checks them) before the hooks look at them. The fast
# clipping path has none: its clip reads the scaled gradients once and folds the scale in.
UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


class AtenOps(TorchDispatchMode):
    """Counts aten ops by name (``counts``) while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
