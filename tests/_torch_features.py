"""What the installed torch can do, for tests that need more than the oldest torch they may meet.

The project's floor is torch 2.13; a GPU image may still ship an older torch (the first GPU machine
had 2.11), and the suite runs there from the source tree. A test that needs a newer torch is
skipped with the version and the missing piece named, never silently.
"""

from __future__ import annotations

import functools

import pytest
import torch

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch < 2.13's Dynamo lists torch.set_autocast_enabled and torch._C._is_autocast_available among
# the functions it will not trace, so a compiled forward that switches autocast breaks the graph.
DYNAMO_TRACES_AUTOCAST_SWITCHES = TORCH >= (2, 13)
DYNAMO_AUTOCAST_REASON = (
    f"torch {torch.__version__} < 2.13: Dynamo cannot trace torch.set_autocast_enabled "
    "or torch._C._is_autocast_available (fp32 functions and modules switch autocast in compiled code)"
)
needs_dynamo_autocast_switches = pytest.mark.skipif(
    not DYNAMO_TRACES_AUTOCAST_SWITCHES, reason=DYNAMO_AUTOCAST_REASON
)


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether ``torch._scaled_mm`` on the CPU takes one scale per row (torch 2.11's takes one per tensor)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except RuntimeError:
        return False
    return True


ROWWISE_ON_CPU_REASON = (
    f"torch {torch.__version__}: the CPU's torch._scaled_mm takes per-tensor scales only, "
    "so the rowwise fp8 recipes cannot run on the CPU (torch 2.13 takes rowwise scales)"
)

needs_cpu_rowwise_fp8 = pytest.mark.skipif(not cpu_rowwise_scaled_mm(), reason=ROWWISE_ON_CPU_REASON)
