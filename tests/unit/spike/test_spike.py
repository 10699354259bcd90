"""``SpikeGuard``: a step whose loss jumps far above its history is skipped like an overflow.

The guard's flag is OR-ed into the step's skip flag on the device: the weights and the optimizer
state stay bit-identical, the step is counted in ``skipped_steps``, the loss scale does not back
off, and the skipped loss does not enter the history.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_plugin import LossScaler
from amp_plugin._step import StepDriver
from amp_plugin.spike import SpikeGuard


def _model(device: str, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True if fused else None)
    return model, opt


def _batches(device: str, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 8, generator=gen).to(device), torch.randn(32, 1, generator=gen).to(device))
        for _ in range(n)
    ]


def _step(
    driver: StepDriver, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any, times: float = 1.0
) -> None:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y) * times
    scaler = driver.scaler
    assert scaler is not None
    scaler.scale(loss).backward()
    driver.step(opt, lambda: False)
    opt.zero_grad(set_to_none=True)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], Any]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


SCALERS: dict[str, Callable[[str, SpikeGuard], LossScaler]] = {
    "guard": lambda d, s: LossScaler(d, init_scale=1.0, dynamic=False, spike_guard=s),
    "fp16-scaler": lambda d, s: LossScaler(d, init_scale=2.0**10, growth_interval=3, spike_guard=s),
}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("kind", list(SCALERS))
def test_one_spiked_batch_is_skipped_state_bit_identical_scale_kept(
    device: str, fused: bool, kind: str
) -> None:
    model, opt = _model(device, fused)
    spike = SpikeGuard(warmup=10, window=50)
    scaler = SCALERS[kind](device, spike)
    driver = StepDriver(scaler)
    batches = _batches(device, 31)
    for batch in batches[:20]:
        _step(driver, model, opt, batch)
    assert scaler.skipped_steps == 0 and spike.spikes() == 0
    before, scale_before, recorded = _snapshot(model, opt), scaler.get_scale(), spike.recorded()

    _step(driver, model, opt, batches[20], times=1e3)  # the spike

    assert driver.last_step_skipped
    assert scaler.skipped_steps == 1 and spike.spikes() == 1
    _assert_same(_snapshot(model, opt), before)
    assert scaler.get_scale() == scale_before  # a spike is no overflow: the scale does not back off
    assert spike.recorded() == recorded  # the skipped loss does not raise the bar for the next one
    for batch in batches[21:]:
        _step(driver, model, opt, batch)
        assert not driver.last_step_skipped
    assert scaler.skipped_steps == 1 and spike.recorded() == recorded + 10


def test_a_spike_is_the_same_skip_as_no_step_at_all(device: str) -> None:
    # The run with a spiked batch in it equals the run that never saw that batch, bit for bit.
    batches = _batches(device, 25)
    runs = []
    for spiked in (True, False):
        model, opt = _model(device, fused=False)
        driver = StepDriver(
            LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=SpikeGuard(warmup=5))
        )
        for i, batch in enumerate(batches):
            if i == 12 and spiked:
                _step(driver, model, opt, batch, times=1e3)
            elif i != 12:
                _step(driver, model, opt, batch)
        runs.append(_snapshot(model, opt))
    _assert_same(runs[0], runs[1])


def test_normal_noise_is_not_skipped(device: str) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard()
    scaler = LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike)
    driver = StepDriver(scaler)
    gen = torch.Generator().manual_seed(3)
    for batch in _batches(device, 400, seed=2):
        # Batch-to-batch noise: the target's scale varies by up to 3x, the batch size by 4x.
        size = int(torch.randint(8, 33, (), generator=gen))
        noise = float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
        _step(driver, model, opt, (batch[0][:size], batch[1][:size] * noise))
    assert scaler.skipped_steps == 0 and spike.spikes() == 0
    assert spike.recorded() == 400


@pytest.mark.parametrize("normal_steps", [7, 8])
def test_no_spike_fires_during_the_warmup(device: str, normal_steps: int) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard(warmup=8, window=20)
    scaler = LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike)
    driver = StepDriver(scaler)
    batches = _batches(device, normal_steps + 1)
    for batch in batches[:normal_steps]:
        _step(driver, model, opt, batch)
    _step(driver, model, opt, batches[normal_steps], times=1e3)
    # 7 recorded losses: still warming up, the step is taken; 8: the warm-up is over, it is skipped.
    assert driver.last_step_skipped is (normal_steps == 8)
    assert spike.spikes() == (normal_steps == 8)


def test_an_overflow_is_not_recorded_and_still_backs_off_the_scale(device: str) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard(warmup=3)
    scaler = LossScaler(device, init_scale=2.0**10, spike_guard=spike)
    driver = StepDriver(scaler)
    batches = _batches(device, 5)
    for batch in batches[:4]:
        _step(driver, model, opt, batch)
    _step(driver, model, opt, batches[4], times=float("inf"))
    assert scaler.skipped_steps == 1 and spike.spikes() == 0 and spike.recorded() == 4
    assert scaler.get_scale() == 2.0**9


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0.0}, r"SpikeGuard\(threshold=0.0\).*HINT"),
        ({"window": 1}, r"SpikeGuard\(window=1\).*HINT"),
        ({"warmup": 1}, r"SpikeGuard\(warmup=1\).*HINT"),
        ({"warmup": 30, "window": 20}, r"warmup <= window.*HINT"),
        ({"min_ratio": 0.5}, r"SpikeGuard\(min_ratio=0.5\).*HINT"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpikeGuard(**kwargs)


def test_a_scaler_refuses_anything_but_a_spike_guard() -> None:
    with pytest.raises(TypeError, match=r"spike_guard=.*HINT"):
        LossScaler("cpu", spike_guard=6.0)  # type: ignore[arg-type]


def test_a_tiny_hugging_face_llama_trains_without_a_spike_skip() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)  # random init: nothing is downloaded
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    spike = SpikeGuard()
    scaler = LossScaler("cpu", init_scale=1.0, dynamic=False, spike_guard=spike)
    driver = StepDriver(scaler)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        # Repeating patterns of random period: a task the model learns, so the loss falls and wobbles.
        period = torch.randint(2, 6, (16, 1), generator=gen)
        tokens = torch.gather(torch.randint(0, 64, (16, 6), generator=gen), 1, torch.arange(32) % period)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        driver.step(opt, lambda: False)
        opt.zero_grad(set_to_none=True)
    assert scaler.skipped_steps == 0 and spike.spikes() == 0 and spike.recorded() == 200


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_spike_check_adds_no_host_read(device: str, fused: bool) -> None:
    from amp_plugin.diagnostics._host_reads import HostReads

    counts = []
    for spike in (None, SpikeGuard(warmup=2)):
        model, opt = _model(device, fused)
        driver = StepDriver(LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike))
        batches = _batches(device, 6)
        for batch in batches[:5]:  # past the warm-up: the check runs in full
            _step(driver, model, opt, batch)
        with HostReads() as mode:
            _step(driver, model, opt, batches[5])
        counts.append(mode.count)
    assert counts[0] == counts[1]  # whatever the step reads (AdamW reads its own step count), no more


def _ranks_worker(rank: int) -> dict[str, Any]:
    model, opt = _model("cpu", fused=False)
    spike = SpikeGuard(warmup=5, on=("loss", "grad_norm"))
    driver = StepDriver(LossScaler("cpu", init_scale=1.0, dynamic=False, spike_guard=spike))
    skipped = []
    for i, batch in enumerate(_batches("cpu", 13, seed=10 + rank)):
        if i == 8 and rank == 0:  # a loss spike on rank 0
            _step(driver, model, opt, batch, times=1e3)
        else:  # a gradient-norm spike on rank 1 at 10
            _grad_spiked_step(driver, model, opt, batch, grad_times=1e3 if (i == 10 and rank == 1) else 1.0)
        skipped.append(driver.last_step_skipped)
    history = driver.scaler.state_dict()["spike_guard"]  # type: ignore[union-attr]
    return {"skipped": skipped, "spikes": spike.spikes(), "history": history}


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_a_spike_on_one_rank_is_skipped_on_every_rank(tmp_path: Any) -> None:
    from tests._ranks import run_ranks

    reports = run_ranks(_ranks_worker, tmp_path, world=2)
    expected = [i in (8, 10) for i in range(13)]
    assert [r["skipped"] for r in reports] == [expected, expected]
    assert [r["spikes"] for r in reports] == [2, 2]
    # The values are agreed (MAX) before the check: every rank keeps the same history, so a
    # checkpoint written by rank 0 resumes every rank.
    assert reports[0]["history"] == reports[1]["history"]
    assert reports[0]["history"]["recorded"] == [11, 11]


# -- the gradient-norm criterion ------------------------------------------------------------------


def _grad_spiked_step(
    driver: StepDriver,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: Any,
    grad_times: float = 1.0,
    clip: float | None = None,
) -> None:
    """A step whose loss value is the batch's own but whose gradients are ``grad_times`` larger."""
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    if grad_times != 1.0:
        # Adds exactly 0 to the loss value, and (grad_times - 1) x the loss's gradient to every gradient.
        loss = loss + (grad_times - 1.0) * (loss - loss.detach())
    scaler = driver.scaler
    assert scaler is not None

    def hooks() -> bool:
        if clip is None:
            return False
        driver.clip_grad_norm_(opt, clip)
        return True

    scaler.scale(loss).backward()
    driver.step(opt, hooks)
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "norm-clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("kind", list(SCALERS))
def test_a_gradient_norm_spike_is_skipped_state_bit_identical(
    device: str, fused: bool, kind: str, clip: float | None
) -> None:
    model, opt = _model(device, fused)
    spike = SpikeGuard(warmup=10, window=50, on=("loss", "grad_norm"))
    scaler = SCALERS[kind](device, spike)
    driver = StepDriver(scaler)
    batches = _batches(device, 26)
    for batch in batches[:20]:
        _grad_spiked_step(driver, model, opt, batch, clip=clip)
    assert scaler.skipped_steps == 0 and spike.spikes() == 0
    before, scale_before = _snapshot(model, opt), scaler.get_scale()

    _grad_spiked_step(driver, model, opt, batches[20], grad_times=1e3, clip=clip)  # same loss, 1e3x grads

    assert driver.last_step_skipped and scaler.skipped_steps == 1 and spike.spikes() == 1
    _assert_same(_snapshot(model, opt), before)
    assert scaler.get_scale() == scale_before
    assert spike.recorded("grad_norm") == 20 and spike.recorded("loss") == 20
    for batch in batches[21:]:
        _grad_spiked_step(driver, model, opt, batch, clip=clip)
        assert not driver.last_step_skipped


def test_the_loss_criterion_alone_lets_a_gradient_spike_through(device: str) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard(warmup=10, window=50)  # on=("loss",), the default
    driver = StepDriver(LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike))
    batches = _batches(device, 21)
    for batch in batches[:20]:
        _grad_spiked_step(driver, model, opt, batch)
    _grad_spiked_step(driver, model, opt, batches[20], grad_times=1e3)
    assert not driver.last_step_skipped and spike.spikes() == 0


def test_the_gradient_norm_alone_lets_a_loss_spike_through(device: str) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard(warmup=10, window=50, on=("grad_norm",))
    driver = StepDriver(LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike))
    batches = _batches(device, 21)
    for batch in batches[:20]:
        _step(driver, model, opt, batch)
    # x1e3 on the loss is x1e3 on the gradients too: here the value alone is x1e3.
    x, y = batches[20]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss = loss.detach() * 999.0 + loss
    driver.scaler.scale(loss).backward()  # type: ignore[union-attr]
    driver.step(opt, lambda: False)
    assert not driver.last_step_skipped and spike.spikes() == 0 and spike.recorded() == 21


def test_normal_noise_fires_neither_criterion(device: str) -> None:
    model, opt = _model(device, fused=False)
    spike = SpikeGuard(on=("loss", "grad_norm"))
    scaler = LossScaler(device, init_scale=1.0, dynamic=False, spike_guard=spike)
    driver = StepDriver(scaler)
    gen = torch.Generator().manual_seed(3)
    for batch in _batches(device, 300, seed=2):
        size = int(torch.randint(8, 33, (), generator=gen))
        noise = float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
        _grad_spiked_step(driver, model, opt, (batch[0][:size], batch[1][:size] * noise), clip=1.0)
    assert scaler.skipped_steps == 0 and spike.spikes() == 0
    assert spike.recorded("loss") == spike.recorded("grad_norm") == 300


class _GradientReads(TorchDispatchMode):
    """Records the aten ops that take a gradient tensor (or a list holding one) as an input."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {g.data_ptr() for g in grads}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def reads(a: Any) -> bool:
            if isinstance(a, torch.Tensor):
                return a.data_ptr() in self.ptrs
            return isinstance(a, (list, tuple)) and any(reads(x) for x in a)

        if any(reads(a) for a in args):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("kind", "fused", "clip"),
    [
        ("guard", False, None),  # the guard's inf check computes per-tensor norms
        ("guard", True, None),
        ("guard", False, 1.0),  # a norm clip computes the total norm
        ("fp16-scaler", True, None),  # the fused step's inf check (per-tensor norms)
        ("fp16-scaler", False, 1.0),
    ],
)
def test_the_gradient_norm_criterion_reads_no_gradient_again(
    device: str, kind: str, fused: bool, clip: float | None
) -> None:
    # The norm the step computes anyway is taken: no op touches the gradients beyond the ones it ran.
    ops = []
    for spike in (None, SpikeGuard(warmup=2, on=("loss", "grad_norm"))):
        model, opt = _model(device, fused)
        driver = StepDriver(SCALERS[kind](device, spike))  # type: ignore[arg-type]
        batches = _batches(device, 6)
        for batch in batches[:5]:
            _grad_spiked_step(driver, model, opt, batch, clip=clip)
        x, y = batches[5]
        driver.scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()  # type: ignore[union-attr]
        mode = _GradientReads([p.grad for p in model.parameters() if p.grad is not None])

        def hooks() -> bool:
            if clip is not None:
                driver.clip_grad_norm_(opt, clip)  # noqa: B023 - run at once, in this iteration
            return clip is not None

        with mode:
            driver.step(opt, hooks)
        assert not driver.last_step_skipped
        ops.append(sorted(mode.ops))
    # As many passes over the gradients with the criterion as without it. (On a CPU the fp16
    # re-check after unscale_ is torch's AMP check without a spike guard, and the per-tensor norms,
    # which give the criterion its norm, with one: the same one pass.)
    assert len(ops[0]) == len(ops[1])
    if not (kind == "fp16-scaler" and clip is None):
        assert ops[0] == ops[1]


@pytest.mark.parametrize("kind", list(SCALERS))
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_gradient_norm_check_adds_no_host_read(device: str, fused: bool, kind: str) -> None:
    from amp_plugin.diagnostics._host_reads import HostReads

    counts = []
    for spike in (None, SpikeGuard(warmup=2, on=("loss", "grad_norm"))):
        model, opt = _model(device, fused)
        driver = StepDriver(SCALERS[kind](device, spike))  # type: ignore[arg-type]
        batches = _batches(device, 6)
        for batch in batches[:5]:  # past the warm-up: the check runs in full
            _step(driver, model, opt, batch)
        with HostReads() as mode:
            _step(driver, model, opt, batches[5])
        counts.append(mode.count)
    assert counts[0] == counts[1]


@pytest.mark.parametrize(
    ("on", "match"),
    [
        ((), r"SpikeGuard\(on=\(\)\).*HINT"),
        (("loss", "gradnorm"), r"SpikeGuard\(on=.*gradnorm.*HINT"),
        (("loss", "loss"), r"SpikeGuard\(on=.*twice.*HINT"),
        ("loss", r"SpikeGuard\(on='loss'\).*HINT"),
    ],
)
def test_bad_signals_are_refused(on: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        SpikeGuard(on=on)


# -- the history in checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SCALERS))
def test_a_resumed_scaler_makes_the_same_skip_decisions_bit_for_bit(device: str, kind: str) -> None:
    # Spikes 3 and 7 steps after the resume: with the history lost, the guard would still be warming up.
    def run(resume_at: int | None) -> tuple[list[bool], Any, dict[str, Any]]:
        model, opt = _model(device, fused=False)
        driver = StepDriver(SCALERS[kind](device, SpikeGuard(warmup=10, window=16, on=("loss", "grad_norm"))))
        skipped = []
        for i, batch in enumerate(_batches(device, 30)):
            if i == resume_at:
                state = copy.deepcopy(driver.scaler.state_dict())  # type: ignore[union-attr]
                spike = SpikeGuard(warmup=10, window=16, on=("loss", "grad_norm"))
                driver = StepDriver(SCALERS[kind](device, spike))
                driver.scaler.load_state_dict(state)  # type: ignore[union-attr]
            if i == 22:  # a loss spike
                _step(driver, model, opt, batch, times=1e3)
            else:  # a gradient-norm spike at 26
                _grad_spiked_step(driver, model, opt, batch, grad_times=1e3 if i == 26 else 1.0)
            skipped.append(driver.last_step_skipped)
        return skipped, _snapshot(model, opt), driver.scaler.state_dict()  # type: ignore[union-attr]

    straight, resumed = run(None), run(19)
    assert [i for i, s in enumerate(straight[0]) if s] == [22, 26]
    assert straight[0] == resumed[0]
    _assert_same(straight[1], resumed[1])
    assert straight[2] == resumed[2]


def test_the_state_dict_holds_the_history_and_refuses_another_window() -> None:
    spike = SpikeGuard(warmup=2, window=4, on=("loss", "grad_norm"))
    scaler = LossScaler("cpu", init_scale=1.0, dynamic=False, spike_guard=spike)
    driver = StepDriver(scaler)
    model, opt = _model("cpu", fused=False)
    for batch in _batches("cpu", 6):
        _step(driver, model, opt, batch)
    state = scaler.state_dict()["spike_guard"]
    assert state["on"] == ["loss", "grad_norm"] and state["recorded"] == [6, 6] and state["spikes"] == 0
    other_spike = SpikeGuard(warmup=2, window=8, on=("loss", "grad_norm"))
    other = LossScaler("cpu", init_scale=1.0, dynamic=False, spike_guard=other_spike)
    with pytest.raises(ValueError, match=r"window.*HINT"):
        other.load_state_dict(scaler.state_dict())
    assert other_spike.recorded() == 0  # nothing was loaded
    plain = LossScaler("cpu", init_scale=1.0, dynamic=False)
    plain.load_state_dict(scaler.state_dict())  # no spike guard here: its history is not wanted
    assert "spike_guard" not in plain.state_dict()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_checkpoints_the_history(precision: str) -> None:
    from lightning.fabric import Fabric

    from amp_plugin.lightning.fabric import AMPPrecision

    def fabric_run(steps: int, state: dict[str, Any] | None) -> tuple[AMPPrecision, SpikeGuard]:
        spike = SpikeGuard(warmup=2, on=("loss", "grad_norm"))
        plugin = AMPPrecision(precision, device="cpu", spike_guard=spike)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, opt = _model("cpu", fused=False)
        model, opt = fabric.setup(model, opt)
        if state is not None:
            plugin.load_state_dict(state)
        for x, y in _batches("cpu", steps):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        return plugin, spike

    plugin, spike = fabric_run(5, None)
    state = copy.deepcopy(plugin.state_dict())
    _, resumed = fabric_run(0, state)
    assert resumed.recorded("loss") == resumed.recorded("grad_norm") == spike.recorded() == 5
    assert resumed.state_dict() == spike.state_dict()


def test_a_grad_norm_spike_guard_refuses_sparse_gradients_before_unscaling_them() -> None:
    embedding = nn.Embedding(5, 2, sparse=True)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = LossScaler("cpu", spike_guard=SpikeGuard(on=("loss", "grad_norm")))
    scaler.scale(embedding(torch.tensor([1, 2])).sum()).backward()
    before = embedding.weight.grad.coalesce().values().clone()
    with pytest.raises(TypeError, match=r"sparse gradients or take their norm.*HINT"):
        scaler.step(opt)
    assert scaler.stage(opt) == "ready"  # nothing was unscaled: the scaler still steps with a dense model
    assert torch.equal(embedding.weight.grad.coalesce().values(), before)
