"""The guarded optimizer step under ``torch.compile``: its only graph breaks are torch's own optimizer.

torch's ``GradScaler`` is not traced at all (dynamo skips it); :class:`~amp_plugin.LossScaler`'s
step is plain tensor code, so dynamo traces it into graphs around the optimizer's ``step``, which
torch keeps out of the graph on purpose (``torch.optim``'s step wrapper breaks the graph, and its
fused kernels are ``torch.compiler.disable``-d). This pins that nothing of ours adds a break: a
``.item()``, a Python branch on a tensor, or an untraceable call on the hot path would show up
here as a break located in ``amp_plugin``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

from amp_plugin import LossScaler
from tests._torch_features import TORCH

OPTIM = str(Path(torch.optim.__file__).parent)
WHERE = re.compile(r"Graph break .*in user code at (?P<file>[^:]+):\d+")


class _Breaks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.files: list[str] = []
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        self.files += [m["file"] for m in WHERE.finditer(message)]


@pytest.fixture
def breaks() -> Iterator[_Breaks]:
    handler = _Breaks()
    logger = logging.getLogger("torch._dynamo")
    torch._dynamo.reset()
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


@pytest.mark.skipif(
    TORCH < (2, 13),
    reason=f"torch {torch.__version__} < 2.13: Dynamo cannot set attributes on the optimizer "
    "(the fused step hands grad_scale and found_inf to it as attributes, as GradScaler does)",
)
@pytest.mark.parametrize(
    ("dtype", "init_scale", "dynamic"),
    [(torch.float16, 2.0**10, True), (torch.bfloat16, 1.0, False)],
    ids=["fp16-scaler", "bf16-guard"],
)
def test_a_fused_guarded_step_breaks_only_at_torchs_optimizer(
    breaks: _Breaks, dtype: torch.dtype, init_scale: float, dynamic: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = LossScaler("cpu", init_scale=init_scale, dynamic=dynamic)

    @torch.compile(backend="eager")
    def step() -> None:
        scaler.step(opt)
        scaler.update()

    for poison in (1.0, float("inf"), 1.0):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(torch.randn(2, 8)).float().sum() * poison
        scaler.scale(loss).backward()
        step()
        opt.zero_grad()

    assert scaler.skipped_steps == 1  # the compiled step still skipped the poisoned one
    assert breaks.files, "no graph break was logged: the optimizer boundary should be one"
    outside = sorted({file for file in breaks.files if not file.startswith(OPTIM)})
    assert not outside, f"graph breaks outside torch.optim: {outside}"
