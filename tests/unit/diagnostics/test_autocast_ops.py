"""Tests for ``amp_plugin.diagnostics._autocast_ops``: which dtype common ops run in under autocast."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from amp_plugin.diagnostics._autocast_ops import AutocastOps, OpProbe, format_autocast_ops, probe_autocast_ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_probe_sorts_ops_by_what_autocast_did(dtype: torch.dtype) -> None:
    result = probe_autocast_ops("cpu", dtype)
    assert (result.device, result.dtype) == ("cpu", dtype)
    rows = {row.op: row for row in result.rows}
    assert {"mm", "linear", "conv2d", "softmax", "layer_norm", "cross_entropy", "sigmoid", "cat"} <= set(rows)
    # mm is on every device's lower-precision list; relu on none; mse_loss on CPU's fp32 list.
    assert (rows["mm"].category, rows["mm"].from_fp32) == ("lower precision", dtype)
    assert (rows["relu"].category, rows["relu"].from_half) == ("promote/unchanged", dtype)
    assert (rows["mse_loss"].category, rows["mse_loss"].from_half) == ("fp32", torch.float32)


def test_each_row_is_what_autocast_really_returned() -> None:
    """The oracle: run the op by hand under autocast and compare the dtypes the probe recorded."""
    result = probe_autocast_ops("cpu", torch.bfloat16)
    x = torch.rand(4, 4)
    by_hand = {
        "mm": (lambda t: torch.mm(t, t)),
        "softmax": (lambda t: torch.softmax(t, -1)),
        "exp": torch.exp,
        "sum": torch.sum,
    }
    rows = {row.op: row for row in result.rows}
    for op, fn in by_hand.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes = (fn(x).dtype, fn(x.bfloat16()).dtype)
        assert (rows[op].from_fp32, rows[op].from_half) == dtypes, op
    for row in result.rows:
        low = row.from_fp32 == torch.bfloat16
        assert row.category == ("lower precision" if low else "fp32" if row.from_half == torch.float32
                                else "promote/unchanged"), row  # fmt: skip


def test_format_lists_every_op_once_per_probe() -> None:
    results = (probe_autocast_ops("cpu", torch.bfloat16), probe_autocast_ops("cpu", torch.float16))
    text = format_autocast_ops(results)
    lines = text.splitlines()
    assert lines[0].startswith("autocast ops") and "cpu bfloat16" in text and "cpu float16" in text
    for row in results[0].rows:
        assert sum(line.split()[0] == row.op for line in lines[1:] if line.strip()) == 1
    assert format_autocast_ops(results[0]) == format_autocast_ops([results[0]])


def test_to_dict_is_json_ready() -> None:
    document = json.loads(json.dumps(probe_autocast_ops("cpu", torch.bfloat16).to_dict()))
    assert document["device"] == "cpu" and document["dtype"] == "bfloat16"
    assert {"op": "mm", "category": "lower precision", "from_fp32": "bfloat16", "from_half": "bfloat16",
            "error": None} in document["rows"]  # fmt: skip


def test_an_op_that_fails_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from amp_plugin.diagnostics import _autocast_ops as autocast_ops

    def broken(t: autocast_ops._Inputs) -> torch.Tensor:
        raise RuntimeError("not implemented for 'BFloat16'")

    monkeypatch.setitem(autocast_ops._OPS, "broken", broken)
    row = {r.op: r for r in probe_autocast_ops("cpu", torch.bfloat16).rows}["broken"]
    assert row == OpProbe("broken", "error", None, None, "RuntimeError: not implemented for 'BFloat16'")
    assert "error" in format_autocast_ops(AutocastOps("cpu", torch.bfloat16, (row,)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": "gpu"}, ValueError, r"device='gpu'.*HINT"),
        ({"device": "cpu", "dtype": torch.float32}, ValueError, r"dtype=torch.float32.*HINT"),
        ({"device": "cpu", "dtype": "bf16"}, TypeError, r"dtype='bf16'.*HINT: .*torch.bfloat16"),
    ],
)
def test_bad_arguments_raise_with_a_hint(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        probe_autocast_ops(**kwargs)


def test_an_absent_cuda_is_refused_with_a_hint() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=r"device='cuda'.*not available.*HINT"):
        probe_autocast_ops("cuda")


@pytest.mark.cuda
def test_cuda_probe_runs_softmax_in_fp32() -> None:
    rows = {row.op: row for row in probe_autocast_ops("cuda", torch.float16).rows}
    assert rows["mm"].category == "lower precision"
    assert rows["softmax"].category == "fp32"  # on CUDA's fp32 list, unlike CPU's
