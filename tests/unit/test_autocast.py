"""Tests for ``amp_plugin.autocast``: precision strings, threads, DataParallel, fp32 modules."""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from amp_plugin.autocast import (
    AutocastDataParallel,
    AutocastState,
    DeviceAutocast,
    auto_precision_reason,
    autocast_state,
    check_device,
    check_module_classes,
    find_data_parallel,
    force_fp32,
    propagate_autocast,
    resolve_precision,
)

T = TypeVar("T")


def cpu_state() -> tuple[bool, torch.dtype, bool]:
    """The calling thread's CPU autocast flag and dtype, and the cache flag."""
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


def in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a fresh ``threading.Thread``; return its result or re-raise its error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class Recorder(nn.Module):
    """A Linear that records, per call, the thread, the CPU autocast state and the input dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append({"state": cpu_state(), "dtype": x.dtype, "thread": threading.get_ident()})
        return self.linear(x)


# ---------------------------------------------------------------- precision strings


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
def test_resolve_precision_explicit_strings_on_cpu(precision: str, dtype: torch.dtype) -> None:
    assert resolve_precision(precision, "cpu") == dtype


def test_auto_picks_bf16_on_cpu_and_says_why() -> None:
    assert resolve_precision("auto", "cpu") == torch.bfloat16
    assert auto_precision_reason("cpu") == "bf16: CPU autocast supports bf16"


def test_fp16_on_cpu_is_honoured() -> None:
    # Lightning turns "16-mixed" into bf16 on CPU (RESEARCH trap 13); we must not.
    dtype = resolve_precision("16-mixed", "cpu")
    with torch.autocast("cpu", dtype=dtype):
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.float16


@pytest.mark.parametrize(
    ("precision", "match"),
    [
        ("16", r"Unknown precision '16'.*HINT: use '16-mixed'"),
        (16, r"Unknown precision 16.*HINT: use '16-mixed'"),
        ("fp16", r"HINT: use '16-mixed'"),
        (torch.float16, r"HINT: use '16-mixed'"),
        ("bf16", r"HINT: use 'bf16-mixed'"),
        ("16-true", r"HINT: this plugin does mixed precision"),
        ("bf16-true", r"HINT: this plugin does mixed precision"),
        ("32-true", r"HINT: for full precision drop the AMP plugin"),
        ("mixed", r"allowed: 16-mixed, bf16-mixed, auto\. HINT: pick one"),
        (None, r"Unknown precision None"),
    ],
)
def test_resolve_precision_rejects_unknown_strings(precision: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_precision(precision, "cpu")


# ---------------------------------------------------------------- device types


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda"),  # an index is harmless where a device type is wanted
        (torch.device("cuda", 1), "cuda"),
        (torch.device("cpu"), "cpu"),
        ("mps", "mps"),
    ],
)
def test_check_device_returns_the_device_type(device: object, expected: str) -> None:
    assert check_device(device, "AMPPrecision") == expected


BAD_DEVICES: list[tuple[object, type[Exception], str]] = [
    ("gpu", ValueError, r"'gpu' is Lightning's accelerator name; the device type is 'cuda'"),
    ("tpu", ValueError, r"'tpu' is Lightning's accelerator name; the device type is 'xla'"),
    ("auto", ValueError, r"HINT: 'auto' is Lightning's accelerator choice, not a device type"),
    ("", ValueError, r"=''\) is not allowed.*HINT: pass a device type such as 'cuda' or 'cpu'"),
    ("CUDA", ValueError, r"HINT: device types are lowercase: 'cuda'"),
    (
        "cuda:x",
        ValueError,
        r"='cuda:x'\) is not allowed: a device type with autocast: .*"
        r"HINT: write the device type alone, e\.g\. 'cuda'",
    ),
    ("meta", ValueError, r"not available for device type 'meta'.*HINT: pass a device type"),
    (torch.device("meta"), ValueError, r"not available for device type 'meta'"),
    (0, TypeError, r"=0\) is not allowed: a str or torch\.device.*HINT: 0 looks like a CUDA index"),
    (None, TypeError, r"=None\) is not allowed: a str or torch\.device.*HINT: pass a device type"),
    (["cuda"], TypeError, r"=\['cuda'\]\) is not allowed.*HINT"),
]


@pytest.mark.parametrize(("device", "error", "match"), BAD_DEVICES)
def test_check_device_rejects_what_is_not_a_device_type(
    device: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^AMPPrecision\(device.*" + match) as info:
        check_device(device, "AMPPrecision")
    assert "'cpu', 'cuda'" in str(info.value)  # the allowed types are listed


@pytest.mark.parametrize(("device", "error", "match"), BAD_DEVICES)
def test_every_device_type_argument_uses_check_device(
    device: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"^resolve_precision\(device_type.*" + match):
        resolve_precision("bf16-mixed", device)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"^auto_precision_reason\(device_type.*" + match):
        auto_precision_reason(device)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"^AutocastState\.device\(device_type.*" + match):
        autocast_state().device(device)  # type: ignore[arg-type]


def test_device_objects_and_indices_are_accepted_where_a_device_type_is_wanted() -> None:
    assert resolve_precision("16-mixed", torch.device("cpu")) == torch.float16
    assert resolve_precision("bf16-mixed", "cpu:0") == torch.bfloat16
    assert auto_precision_reason(torch.device("cpu")) == auto_precision_reason("cpu")
    assert autocast_state().device(torch.device("cpu")).device_type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_precision_without_cuda_raises() -> None:
    with pytest.raises(ValueError, match=r"CUDA is not available\. HINT: "):
        resolve_precision("16-mixed", "cuda")


def fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """Pretend a CUDA device of ``capability`` is present (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
    )


@pytest.mark.parametrize(
    ("capability", "dtype", "reason"),
    [
        ((9, 0), torch.bfloat16, "bf16: CUDA device with compute capability 9.0 >= 8.0"),
        ((8, 0), torch.bfloat16, "bf16: CUDA device with compute capability 8.0 >= 8.0"),
        ((7, 5), torch.float16, "fp16: CUDA device with compute capability 7.5 < 8.0 (no bf16)"),
    ],
)
def test_auto_on_cuda_follows_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], dtype: torch.dtype, reason: str
) -> None:
    fake_cuda(monkeypatch, capability)
    assert resolve_precision("auto", "cuda") == dtype
    assert auto_precision_reason("cuda") == reason


def test_bf16_on_cuda_without_bf16_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, (7, 0))
    assert resolve_precision("16-mixed", "cuda") == torch.float16
    with pytest.raises(ValueError, match=r"'bf16-mixed'.*no bf16 support\. HINT: use '16-mixed'"):
        resolve_precision("bf16-mixed", "cuda")


def test_dtype_the_backend_does_not_support_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PrivateUse1 backend declares its autocast dtypes, as torch.autocast reads them.
    backend = torch._C._get_privateuse1_backend_name()
    with pytest.raises(ValueError, match=r"supports only \[\]\. HINT: use another device type"):
        resolve_precision("bf16-mixed", backend)
    module = types.SimpleNamespace(get_amp_supported_dtype=lambda: [torch.bfloat16])
    monkeypatch.setattr(torch, backend, module, raising=False)
    with pytest.raises(ValueError, match=r"needs torch\.float16 autocast.*HINT: use 'bf16-mixed'"):
        resolve_precision("16-mixed", backend)
    assert resolve_precision("auto", backend) == torch.bfloat16


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
        (None, r"fn=None\) is not allowed: a callable.*HINT: pass the function itself"),
        ("torch.mm", r"fn='torch\.mm'\) is not allowed: a callable"),
        (torch.ones(1), r"fn=Tensor\) is not allowed: a callable"),
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
    match = r"^AutocastDataParallel\(module=.*\) is not allowed: a torch\.nn\.Module instance\. HINT"
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
    assert run(nn.DataParallel) == ({torch.float16}, torch.float16)  # RESEARCH trap 4, in torch 2.13


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
