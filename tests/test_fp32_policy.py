"""Tests for ``amp_plugin.fp32_policy``: modules forced to fp32 with autocast off."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin.autocast import propagate_autocast
from amp_plugin.fp32_policy import check_module_classes, force_fp32
from tests._autocast_probes import Recorder, cpu_state

# ---------------------------------------------------------------- fp32 modules


class Norm(Recorder):
    """A module class to force to fp32."""


def model_with_norm() -> tuple[nn.Sequential, Norm]:
    norm = Norm()
    return nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4)), norm


def test_forced_module_runs_in_fp32_with_autocast_off() -> None:
    model, norm = model_with_norm()
    hooks = force_fp32(model, (Norm,))
    assert hooks.names == ("1",)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 4))
        assert cpu_state() == (True, torch.bfloat16, True)
    assert norm.calls[0]["dtype"] == torch.float32  # the bf16 output of the Linear before was cast up
    assert norm.calls[0]["state"][0] is False
    assert out.dtype == torch.bfloat16  # the neighbour after it still runs in bf16


def test_forced_module_casts_nested_args_and_kwargs() -> None:
    seen: dict[str, Any] = {}

    class Many(nn.Module):
        def forward(self, x: Any, pair: Any, *, table: Any, count: torch.Tensor, wide: torch.Tensor) -> None:
            seen.update(x=x.dtype, pair=[t.dtype for t in pair], table={k: v.dtype for k, v in table.items()})
            seen.update(count=count.dtype, wide=wide.dtype, kinds=(type(pair), type(table)))

    module = Many()
    force_fp32(module, (Many,))
    half, bf16 = torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.bfloat16)
    table = {"a": half, "b": bf16}
    module(half, [bf16, half], table=table, count=torch.ones(1, dtype=torch.int64), wide=half.double())
    assert seen["x"] == torch.float32
    assert seen["pair"] == [torch.float32, torch.float32]
    assert seen["table"] == {"a": torch.float32, "b": torch.float32}
    assert (seen["count"], seen["wide"]) == (torch.int64, torch.float64)  # ints and fp64 stay as they are
    assert seen["kinds"] == (list, dict)


def test_exception_in_forced_forward_restores_autocast() -> None:
    class Exploding(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input")

    model = nn.Sequential(Exploding())
    force_fp32(model, (Exploding,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="bad input"):
            model(torch.randn(2, 4))
        assert cpu_state() == (True, torch.bfloat16, True)


def test_error_in_an_earlier_pre_hook_leaves_the_outer_region_alone() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Norm()
            self.state_after_inner: tuple[bool, torch.dtype, bool] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with contextlib.suppress(RuntimeError):
                self.inner(x)
            self.state_after_inner = cpu_state()
            return x

    def refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError("refused")

    model = Outer()
    force_fp32(model, (Outer, Norm))
    model.inner.register_forward_pre_hook(refuse, prepend=True)  # runs before ours, so ours never runs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
        assert cpu_state() == (True, torch.bfloat16, True)
    assert model.state_after_inner == (False, torch.bfloat16, True)


def test_nested_forced_modules() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Norm()
            self.states: list[tuple[bool, torch.dtype, bool]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.states.append(cpu_state())
            y = self.inner(x)
            self.states.append(cpu_state())
            return y

    model = Outer()
    hooks = force_fp32(model, (Outer, Norm))
    assert hooks.names == ("", "inner")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 4).to(torch.bfloat16))
        assert cpu_state() == (True, torch.bfloat16, True)
    assert [s[0] for s in model.states] == [False, False]
    assert model.inner.calls[0]["state"][0] is False
    assert out.dtype == torch.float32  # outputs of forced modules stay fp32


def test_remove_restores_plain_autocast() -> None:
    model, norm = model_with_norm()
    force_fp32(model, (Norm,)).remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
    assert norm.calls[0]["state"][0] is True
    assert norm.calls[0]["dtype"] == torch.bfloat16


def test_forced_modules_work_from_threads() -> None:
    model, norm = model_with_norm()
    force_fp32(model, (Norm,))
    barrier = threading.Barrier(2)

    def step() -> torch.dtype:
        barrier.wait()  # both threads inside the model at once: the open regions must be per thread
        out = model(torch.randn(2, 4))
        assert cpu_state() == (True, torch.bfloat16, True)
        return out.dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped = propagate_autocast(step)
    threads = [threading.Thread(target=wrapped) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(norm.calls) == 2
    assert all(call["state"][0] is False and call["dtype"] == torch.float32 for call in norm.calls)
    assert cpu_state() == (False, torch.bfloat16, True)


def test_no_matching_module_adds_no_hooks() -> None:
    model, _ = model_with_norm()
    hooks = force_fp32(model, ())
    assert hooks.names == ()
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("model", "classes", "match"),
    [
        ("model", (Norm,), r"^force_fp32\(model='model'\) is not allowed: a torch\.nn\.Module\. HINT: "),
        (nn.Linear(2, 2), (int,), r"classes=\(<class 'int'>,\)"),
    ],
)
def test_force_fp32_rejects_bad_arguments(model: Any, classes: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        force_fp32(model, classes)


@pytest.mark.parametrize(
    ("classes", "match"),
    [
        (nn.LayerNorm, r"classes=<class .*LayerNorm'>; allowed: a tuple .*HINT: wrap the class in a tuple: "
         r"\(LayerNorm,\)"),
        ((nn.LayerNorm(2),), r"allowed: a tuple of torch\.nn\.Module subclasses\. HINT: LayerNorm\(.*\) is "
         r"an instance; pass its class, LayerNorm"),
        ((nn.LayerNorm, int), r"HINT: int is not a torch\.nn\.Module subclass"),
        ((nn.Linear, "LayerNorm"), r"HINT: 'LayerNorm' is not a class; pass the class itself"),
        ({nn.LayerNorm}, r"HINT: pass a tuple \(or list\), e\.g\. \(torch\.nn\.LayerNorm,\)"),
    ],
)  # fmt: skip
def test_module_classes_errors_say_what_is_wrong_and_add_no_hooks(classes: Any, match: str) -> None:
    model, _ = model_with_norm()
    with pytest.raises(TypeError, match=match):
        check_module_classes(classes)
    with pytest.raises(TypeError, match=match):
        force_fp32(model, classes)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
