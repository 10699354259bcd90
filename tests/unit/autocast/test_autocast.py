"""Tests for ``amp_plugin.autocast``: autocast state across threads, DataParallel."""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from amp_plugin import fp32_policy
from amp_plugin.autocast import (
    AutocastDataParallel,
    AutocastState,
    DeviceAutocast,
    autocast_state,
    find_data_parallel,
    propagate_autocast,
)
from amp_plugin.precision import resolve_precision
from tests._autocast_probes import Recorder, cpu_state, in_thread


def test_nothing_here_initialises_cuda() -> None:
    if torch.cuda.is_initialized():
        pytest.skip("CUDA was initialised by an earlier test")
    resolve_precision("auto", "cpu")
    with autocast_state().apply():
        propagate_autocast(lambda: None)()
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------- autocast state and threads


def test_autocast_state_captures_every_device_and_the_cache_flag() -> None:
    outside = autocast_state()
    assert not outside.device("cpu").enabled
    assert not outside.device("cuda").enabled
    assert outside.cache_enabled
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        inside = autocast_state()
    assert inside.device("cpu").enabled
    assert inside.device("cpu").dtype == torch.float16
    assert not inside.cache_enabled
    assert inside.disabled().device("cpu") == DeviceAutocast("cpu", False, torch.float16)
    with pytest.raises(ValueError, match=r"not available for device type 'meta'"):
        inside.device("meta")


def test_apply_round_trip_and_restore() -> None:
    before = autocast_state()
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        captured = autocast_state()
    with captured.apply():
        assert autocast_state() == captured
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    assert autocast_state() == before


def test_nested_apply_restores_each_level() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = autocast_state()
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        fp16 = autocast_state()
    with bf16.apply():
        with fp16.apply():
            assert cpu_state() == (True, torch.float16, False)
            with bf16.disabled().apply():
                assert cpu_state() == (False, torch.bfloat16, True)
            assert cpu_state() == (True, torch.float16, False)
        assert cpu_state() == (True, torch.bfloat16, True)
    assert not torch.is_autocast_enabled("cpu")


def test_apply_restores_after_an_exception() -> None:
    before = autocast_state()
    with torch.autocast("cpu", dtype=torch.float16):
        captured = autocast_state()
    with pytest.raises(RuntimeError, match="boom"), captured.apply():
        raise RuntimeError("boom")
    assert autocast_state() == before


def test_a_plain_thread_loses_the_callers_autocast() -> None:
    # The trap this module exists for: autocast state is thread-local.
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        assert in_thread(cpu_state) == (False, torch.bfloat16, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_enabled", [True, False])
def test_propagate_autocast_carries_dtype_and_cache_flag(dtype: torch.dtype, cache_enabled: bool) -> None:
    linear = nn.Linear(4, 4)

    def work() -> tuple[tuple[bool, torch.dtype, bool], torch.dtype]:
        return cpu_state(), linear(torch.randn(2, 4)).dtype

    with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
        wrapped = propagate_autocast(work)
        main_before = cpu_state()
        assert in_thread(wrapped) == ((True, dtype, cache_enabled), dtype)
        assert cpu_state() == main_before
    # The state was captured at wrap time: calling later, outside autocast, still uses it.
    assert in_thread(wrapped) == ((True, dtype, cache_enabled), dtype)
    assert cpu_state() == (False, torch.bfloat16, True)


def test_propagate_autocast_keeps_the_wrapped_metadata() -> None:
    def scaled(x: int) -> int:
        """Doc."""
        return 2 * x

    wrapped = propagate_autocast(scaled)
    assert (wrapped.__name__, wrapped.__doc__, wrapped(3)) == ("scaled", "Doc.", 6)
    assert isinstance(autocast_state(), AutocastState)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (None, r"fn=None\) is not allowed here: .*a callable.*HINT: pass the function itself"),
        ("torch.mm", r"fn='torch\.mm'\) is not allowed here: .*a callable"),
        (torch.ones(1), r"fn=Tensor\) is not allowed here: .*a callable"),
    ],
)
def test_propagate_autocast_refuses_a_non_callable_when_wrapping(fn: Any, match: str) -> None:
    with pytest.raises(TypeError, match=r"^propagate_autocast\(" + match):
        propagate_autocast(fn)


# ---------------------------------------------------------------- DataParallel


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel takes the GPUs when there are some")
def test_autocast_data_parallel_without_devices_calls_the_module() -> None:
    recorder = Recorder()
    model = AutocastDataParallel(recorder)
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.float16
    assert recorder.calls[0]["state"] == (True, torch.float16, False)


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let torch's real ``parallel_apply`` fan out its threads on CPU: it insists on an accelerator."""
    accelerator = getattr(torch, "accelerator", None)
    needed = ("is_available", "current_accelerator", "current_stream", "device_index")
    if torch.cuda.is_available() or not all(hasattr(accelerator, name) for name in needed):
        pytest.skip("needs a machine without an accelerator and torch.accelerator (torch >= 2.6)")
    monkeypatch.setattr(accelerator, "is_available", lambda: True)
    monkeypatch.setattr(accelerator, "current_accelerator", lambda check_available=False: torch.device("cpu"))
    monkeypatch.setattr(accelerator, "current_stream", lambda device=None: contextlib.nullcontext())
    monkeypatch.setattr(accelerator, "device_index", lambda device: contextlib.nullcontext())


@pytest.mark.parametrize("module", ["model", None, Recorder])
def test_autocast_data_parallel_refuses_what_is_not_a_module_when_built(module: Any) -> None:
    # Without GPUs nn.DataParallel keeps anything and fails only at the first forward.
    match = r"^AutocastDataParallel\(module=.*\) is not allowed here: .*a torch\.nn\.Module instance\. HINT"
    with pytest.raises(TypeError, match=match):
        AutocastDataParallel(module)


def two_replicas() -> tuple[list[Recorder], list[tuple[torch.Tensor]]]:
    recorder = Recorder()
    return [recorder, copy.deepcopy(recorder)], [(torch.randn(2, 4),), (torch.randn(2, 4),)]


@pytest.mark.usefixtures("fake_accelerator")
def test_torch_parallel_apply_loses_the_state_and_ours_keeps_it() -> None:
    theirs, inputs = two_replicas()
    ours, _ = two_replicas()
    model = AutocastDataParallel(nn.Identity())
    model.device_ids = [0, 0]  # two "devices", as DataParallel would hold on a GPU machine
    main = threading.get_ident()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        torch_out = torch.nn.parallel.parallel_apply(theirs, inputs, None, [0, 0])
        ours_out = model.parallel_apply(ours, inputs, [{}, {}])
        caller = cpu_state()
    assert caller == (True, torch.bfloat16, False)
    assert [m.calls[0]["state"] for m in theirs] != [caller, caller]  # torch's replicas lose it
    assert {out.dtype for out in torch_out} == {torch.float32}
    assert [m.calls[0]["state"] for m in ours] == [caller, caller]
    assert {out.dtype for out in ours_out} == {torch.bfloat16}
    assert main not in {m.calls[0]["thread"] for m in [*theirs, *ours]}  # replicas ran in their own threads
    assert cpu_state() == (False, torch.bfloat16, True)


@pytest.mark.usefixtures("fake_accelerator")
def test_parallel_apply_reraises_a_replica_error_and_restores_state() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("replica failed")

    model = AutocastDataParallel(nn.Identity())
    model.device_ids = [0, 0]
    inputs = [(torch.randn(1),), (torch.randn(1),)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="replica failed"):
            model.parallel_apply([Broken(), Broken()], inputs, [{}, {}])
        assert cpu_state() == (True, torch.bfloat16, True)


def test_find_data_parallel_names_plain_data_parallel_only() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.DataParallel(nn.Linear(2, 2)))
    model = nn.Sequential(inner, AutocastDataParallel(nn.Linear(2, 2)))
    assert find_data_parallel(model) == ["0.1"]
    assert find_data_parallel(nn.DataParallel(nn.Linear(2, 2))) == [""]
    assert find_data_parallel(AutocastDataParallel(nn.Linear(2, 2))) == []
    with pytest.raises(TypeError, match=r"^find_data_parallel\(module=list\) is not allowed.*HINT"):
        find_data_parallel([nn.DataParallel(nn.Linear(2, 2))])  # type: ignore[arg-type]


@pytest.mark.cuda
def test_autocast_data_parallel_keeps_bf16_in_cuda_replicas() -> None:
    def run(wrapper: type[nn.DataParallel]) -> tuple[set[torch.dtype], torch.dtype]:  # type: ignore[type-arg]
        seen: set[torch.dtype] = set()
        linear = nn.Linear(8, 8).cuda()
        linear.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
        model = wrapper(linear, device_ids=[0, 0])  # two replicas on one GPU, in two threads
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8, device="cuda"))
        return seen, out.dtype

    assert run(AutocastDataParallel) == ({torch.bfloat16}, torch.bfloat16)
    # nn.DataParallel's replica threads fall back to fp16 (torch 2.13): the bf16 request is lost.
    assert run(nn.DataParallel) == ({torch.float16}, torch.float16)


@pytest.mark.usefixtures("fake_accelerator")
def test_parallel_apply_carries_fp32_functions_into_replica_threads() -> None:
    seen: list[tuple[int, torch.dtype]] = []

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((threading.get_ident(), torch.sigmoid(x.bfloat16()).dtype))
            return x

    model = AutocastDataParallel(nn.Identity())
    model.device_ids = [0, 0]
    inputs = [(torch.randn(2),), (torch.randn(2),)]
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_policy.Fp32Functions(torch.sigmoid):
        torch.nn.parallel.parallel_apply([Gate(), Gate()], inputs, None, [0, 0])
        theirs = [dtype for _, dtype in seen]
        seen.clear()
        model.parallel_apply([Gate(), Gate()], inputs, [{}, {}])
    assert theirs == [torch.bfloat16] * 2  # torch's replica threads lose the mode
    assert [dtype for _, dtype in seen] == [torch.float32] * 2
    assert threading.get_ident() not in {thread for thread, _ in seen}
