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

from amp_plugin import LossScaler
from amp_plugin.spike import SpikeGuard
from amp_plugin.step import StepDriver


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
    from amp_plugin.diagnostics.host_reads import HostReads

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


def _ranks_worker(rank: int, store: str, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from tests._ranks import leave_group

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model, opt = _model("cpu", fused=False)
    spike = SpikeGuard(warmup=5)
    driver = StepDriver(LossScaler("cpu", init_scale=1.0, dynamic=False, spike_guard=spike))
    skipped = []
    for i, batch in enumerate(_batches("cpu", 12, seed=10 + rank)):
        _step(driver, model, opt, batch, times=1e3 if (i == 8 and rank == 0) else 1.0)
        skipped.append(driver.last_step_skipped)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"skipped": skipped, "spikes": spike.spikes()}))
    leave_group()


def test_a_spike_on_one_rank_is_skipped_on_every_rank(tmp_path: Any) -> None:
    from tests._ranks import run_ranks

    reports = run_ranks(_ranks_worker, tmp_path, world=2)
    expected = [i == 8 for i in range(12)]
    assert [r["skipped"] for r in reports] == [expected, expected]
    assert [r["spikes"] for r in reports] == [1, 1]  # the flag is agreed (MAX) before the skip
