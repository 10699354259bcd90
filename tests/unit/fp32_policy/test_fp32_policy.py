"""Tests for ``amp_plugin.fp32_policy``: modules forced to fp32 with autocast off."""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from amp_plugin.autocast import AutocastDataParallel, autocast_state, propagate_autocast
from amp_plugin.fp32_policy import Fp32Functions, check_functions, check_module_classes, force_fp32
from tests._autocast_probes import Recorder, cpu_state, in_thread
from tests._torch_features import needs_dynamo_autocast_switches

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


def test_forced_module_and_registered_function_keep_the_kind_of_a_mapping() -> None:
    seen: list[Any] = []

    class Takes(nn.Module):
        def forward(self, table: Any) -> None:
            seen.append((type(table), getattr(table, "default_factory", None), list(table)))
            seen.append({k: v.dtype for k, v in table.items()})

    class Spy(TorchFunctionMode):  # entered first, so it sees what Fp32Functions passes on
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return Takes()(args[0]) if func is F.relu else func(*args, **(kwargs or {}))

    half = torch.ones(1, dtype=torch.float16)
    tables: list[dict[str, Any]] = [
        collections.defaultdict(list, b=half, a=half),
        collections.OrderedDict(b=half, a=half),
    ]
    module = Takes()
    force_fp32(module, (Takes,))
    for table in tables:
        module(table)
    with Spy(), Fp32Functions(F.relu):
        for table in tables:
            F.relu(table)  # type: ignore[arg-type]
    expected = [(collections.defaultdict, list, ["b", "a"]), (collections.OrderedDict, None, ["b", "a"])]
    assert seen[0::2] == expected * 2
    assert seen[1::2] == [{"b": torch.float32, "a": torch.float32}] * 4
    assert tables[0]["b"].dtype == torch.float16  # the caller's mapping is not changed


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
        ("model", (Norm,), r"^force_fp32\(model='model'\) is not allowed here: "
            r".*a torch\.nn\.Module\. HINT: "),
        (nn.Linear(2, 2), (int,), r"classes=\(<class 'int'>,\)"),
    ],
)
def test_force_fp32_rejects_bad_arguments(model: Any, classes: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        force_fp32(model, classes)


@pytest.mark.parametrize(
    ("classes", "match"),
    [
        (nn.LayerNorm, r"classes=<class .*LayerNorm'>\) is not allowed here: "
            r".*a tuple .*HINT: wrap the class in a "
         r"tuple: \(LayerNorm,\)"),
        ((nn.LayerNorm(2),), r"Allowed: a tuple of torch\.nn\.Module subclasses\. HINT: LayerNorm\(.*\) is "
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


# ---------------------------------------------------------------- fp32 functions


def test_check_functions_accepts_one_callable_or_a_sequence_and_dedupes() -> None:
    functions = (torch.sigmoid, torch.Tensor.softmax, F.gelu, torch.sigmoid)
    assert check_functions(functions) == (torch.sigmoid, torch.Tensor.softmax, F.gelu)
    assert check_functions(torch.sigmoid) == (torch.sigmoid,)
    assert check_functions([]) == ()
    names = "torch.sigmoid, torch.Tensor.softmax, torch.nn.functional.gelu"
    assert repr(Fp32Functions(functions)) == f"Fp32Functions({names})"


@pytest.mark.parametrize(
    ("functions", "match"),
    [
        ("sigmoid", r"functions='sigmoid'\) is not allowed here: .*.*HINT: pass the function itself"),
        ((torch.sigmoid, "softmax"), r"'softmax' is a name; pass the function itself"),
        ((nn.Sigmoid,), r"Sigmoid is a class; .*fp32_modules="),
        ((1.5,), r"1.5 is not callable"),
        (None, r"functions=None\) is not allowed"),
        ((lambda x: x,), r"HINT: torch does not dispatch .*custom_fwd"),
        ((torch.Tensor.sigmoid_,), r"sigmoid_ works in place.*\(e.g. sigmoid\)"),
        ((torch.relu_,), r"relu_ works in place"),
        ((torch.Tensor.__iadd__,), r"__iadd__ works in place.*__add__"),
        ((torch.Tensor.__ilshift__,), r"__ilshift__ works in place.*__lshift__"),
        ((torch.Tensor.__setitem__,), r"__setitem__ \(x\[i\] = v\) writes into the tensor"),
    ],
)
def test_check_functions_refuses_what_is_not_a_torch_function(functions: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        check_functions(functions)


# Python's augmented assignments (x += y, x <<= y, ...): each writes into its left operand.
IN_PLACE_OPERATORS = [n for n in dir(operator) if n.startswith("__i") and hasattr(operator, f"__{n[3:]}")]


@pytest.mark.parametrize("name", [n for n in IN_PLACE_OPERATORS if hasattr(torch.Tensor, n)])
def test_check_functions_refuses_every_in_place_operator(name: str) -> None:
    with pytest.raises(TypeError, match="works in place"):  # __ipow__ is pow_, __itruediv__ __idiv__
        check_functions(getattr(torch.Tensor, name))


def test_check_functions_accepts_dunders_that_only_start_like_in_place_ones() -> None:
    dunders = (torch.Tensor.__invert__, torch.Tensor.__index__, torch.Tensor.__int__)
    assert check_functions(dunders) == dunders


def test_registered_function_runs_in_fp32_with_autocast_off_and_others_keep_autocast() -> None:
    seen: list[Any] = []
    linear = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.float16), Fp32Functions((torch.sigmoid, torch.cat)):
        hidden = linear(torch.randn(2, 4))
        out = torch.sigmoid(hidden)
        joined = torch.cat([hidden, hidden.half()])
        plain = torch.tanh(hidden)
        seen.append(torch.mm(hidden, hidden.t()).dtype)  # autocast is back on after the call
    assert hidden.dtype == torch.float16
    assert (out.dtype, joined.dtype, plain.dtype, seen[0]) == (torch.float32,) * 2 + (torch.float16,) * 2
    torch.testing.assert_close(out, torch.sigmoid(hidden.float()))


def test_registered_function_sees_autocast_disabled_and_fp32_inputs_nested() -> None:
    calls: list[Any] = []

    class Spy(TorchFunctionMode):  # entered first, so it sees what Fp32Functions passes on
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.cat:
                calls.append((torch.is_autocast_enabled("cpu"), [t.dtype for t in args[0]]))
            return func(*args, **(kwargs or {}))

    half = torch.ones(2, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16), Spy(), Fp32Functions(torch.cat):
        torch.cat((half, half.bfloat16(), half.long(), half.double()))
    assert calls == [(False, [torch.float32, torch.float32, torch.int64, torch.float64])]


def test_an_out_tensor_is_written_not_a_copy_of_it() -> None:
    out = torch.empty(2, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), Fp32Functions(torch.sigmoid):
        result = torch.sigmoid(torch.zeros(2, dtype=torch.float16), out=out)
    assert result is out and out.tolist() == [0.5, 0.5]


def test_an_in_place_call_of_a_registered_function_writes_into_the_callers_tensor() -> None:
    y = torch.full((3,), -1.0, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions((F.relu, F.leaky_relu)):
        assert F.relu(y, inplace=True) is y
        assert F.leaky_relu(y - 1, 0.5, True).tolist() == [-0.5] * 3  # inplace given by position
        assert nn.ReLU(inplace=True)(y) is y
        assert F.relu(y).dtype == torch.float32  # without inplace the call still runs in fp32
    assert y.dtype == torch.bfloat16 and y.tolist() == [0.0, 0.0, 0.0]


def test_tensor_methods_are_registered_separately_from_torch_functions() -> None:
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with Fp32Functions(torch.Tensor.softmax):
        assert x.softmax(-1).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.bfloat16  # another function object: not registered
    with Fp32Functions(F.softmax):
        assert F.softmax(x, -1).dtype == torch.float32


def test_calls_made_inside_another_torch_function_are_not_seen() -> None:
    """The documented limit: torch suspends the mode while a function it dispatched runs."""
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with Fp32Functions(torch.Tensor.softmax):
        assert F.softmax(x, -1).dtype == torch.bfloat16  # F.softmax calls x.softmax inside itself
        assert x.softmax(-1).dtype == torch.float32


def test_gradient_flows_back_in_the_input_dtype() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions(torch.sigmoid):
        hidden = torch.mm(x, torch.ones(4, 4))
        hidden.retain_grad()
        loss = torch.sigmoid(hidden).sum()
    loss.backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_nesting_and_reentry_restore_the_outer_state() -> None:
    mode = Fp32Functions(torch.sigmoid)
    x = torch.randn(2, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), mode:
        with mode, Fp32Functions(torch.tanh):
            assert (torch.sigmoid(x).dtype, torch.tanh(x).dtype) == (torch.float32, torch.float32)
        assert (torch.sigmoid(x).dtype, torch.tanh(x).dtype) == (torch.float32, torch.float16)
        assert cpu_state() == (True, torch.float16, True)
    assert torch.sigmoid(x).dtype == torch.float16


def test_an_error_inside_a_registered_call_leaves_autocast_as_it_was() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions(torch.mm):
        with pytest.raises(RuntimeError):
            torch.mm(torch.ones(2, 3), torch.ones(2, 3))
        assert cpu_state() == (True, torch.bfloat16, True)


def test_the_mode_reaches_threads_through_propagate_autocast_and_data_parallel() -> None:
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions(torch.sigmoid):
        sigmoid = propagate_autocast(lambda: torch.sigmoid(torch.mm(x, x.t())).dtype)
        model = AutocastDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()))
        in_model = model(x).dtype
    assert in_thread(sigmoid) == torch.float32
    assert in_thread(lambda: torch.sigmoid(x.bfloat16()).dtype) == torch.bfloat16  # nothing leaks
    assert in_model == torch.float32


def test_the_mode_is_not_entered_twice_in_one_thread() -> None:
    calls: list[Any] = []

    class Counting(Fp32Functions):
        def __torch_function__(self, func: Any, *rest: Any, **kwargs: Any) -> Any:
            calls.append(func)
            return super().__torch_function__(func, *rest, **kwargs)

    with Counting(torch.sigmoid), autocast_state().apply():
        torch.sigmoid(torch.ones(1))
    assert calls.count(torch.sigmoid) == 1


def test_fp32_module_inside_the_mode_keeps_the_mode() -> None:
    model, norm = model_with_norm()
    force_fp32(model, (Norm,))
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions(torch.sigmoid):
        model(torch.randn(2, 4))
        assert torch.sigmoid(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.float32
    assert norm.calls[0]["dtype"] == torch.float32


@needs_dynamo_autocast_switches
def test_compiled_forward_under_the_mode() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.mm(x, x))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions(torch.sigmoid):
        out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.sigmoid(torch.mm(x.bfloat16(), x.bfloat16()).float()))


class _Steps(nn.Module):
    """Makes a tensor of the default dtype in its forward, as a rotary embedding makes its frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(8) / 3
        if self.fail:
            raise KeyError("boom")
        return x + steps


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_forced_module_makes_its_tensors_in_fp32_under_a_half_default_dtype(half: torch.dtype) -> None:
    # The "-true" precisions make the half dtype torch's default in forward passes; a module asked
    # to run in fp32 must not compute its own constants in half.
    model = nn.Sequential(_Steps())
    hooks = force_fp32(model, (_Steps,))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(half)
    try:
        out = model(torch.zeros(8))
        inside_after = torch.get_default_dtype()
        model[0].fail = True
        with pytest.raises(KeyError):  # an error inside the module puts the default dtype back too
            model(torch.zeros(8))
        after_error = torch.get_default_dtype()
    finally:
        torch.set_default_dtype(previous)
        hooks.remove()
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.arange(8, dtype=torch.float32) / 3)
    assert inside_after == half and after_error == half


def test_nothing_in_torch_is_patched_inside_or_after_the_mode() -> None:
    """comparison.md: a mode on what you pass in, where Apex's register_float_function patches torch."""
    names = [(torch, "softmax"), (F, "softmax"), (torch.Tensor, "softmax"), (torch, "matmul")]
    before = [getattr(owner, name) for owner, name in names]
    x = torch.randn(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Functions([torch.softmax, F.softmax]):
        inside = [getattr(owner, name) for owner, name in names]
        assert F.softmax(x @ x.T, dim=-1).dtype == torch.float32  # the mode acts on the call
    assert all(a is b for a, b in zip(before, inside, strict=True))
    assert all(a is getattr(owner, name) for a, (owner, name) in zip(before, names, strict=True))
