"""The one-launch Triton sum of squares behind the torch backend's CUDA norm (``kernels._triton``)."""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin.kernels import _triton, get_kernels

pytestmark = pytest.mark.cuda


def _needs_triton() -> None:
    if _triton._kernel() is None:
        pytest.skip("Triton does not import here")


def _fp64_sum_of_squares(group: list[torch.Tensor]) -> float:
    return float(sum((t.double() ** 2).sum() for t in group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sum_of_squares_is_fp64_truth_to_fp32_rounding(dtype: torch.dtype) -> None:
    _needs_triton()
    gen = torch.Generator().manual_seed(0)
    chunk = _triton._CHUNK
    sizes = [1, 3, chunk - 1, chunk, chunk + 1, 3 * chunk + 17, 1000]
    group = [torch.randn(n, generator=gen).to(dtype).cuda() for n in sizes]
    assert _triton.usable(group)
    got = _triton.sum_of_squares(group)
    assert got.dtype == torch.float32 and got.device == group[0].device and got.dim() == 0
    assert math.isclose(got.item(), _fp64_sum_of_squares(group), rel_tol=1e-6)


def test_unaligned_views_and_new_addresses_are_read_right() -> None:
    _needs_triton()
    flat = torch.randn(3 * _triton._CHUNK + 5, device="cuda")
    group = [flat[1:], flat[7 : 7 + 100]]  # addresses 4 and 28 bytes past an aligned block
    assert math.isclose(_triton.sum_of_squares(group).item(), _fp64_sum_of_squares(group), rel_tol=1e-6)
    again = [t.clone() * 2 for t in group]  # same sizes, other addresses: a plan of their own
    assert math.isclose(_triton.sum_of_squares(again).item(), 4 * _fp64_sum_of_squares(group), rel_tol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_nonfinite_element_makes_the_sum_nonfinite(bad: float) -> None:
    _needs_triton()
    group = [torch.ones(_triton._CHUNK + 9, device="cuda"), torch.ones(5, device="cuda")]
    group[0][-1] = bad
    assert not torch.isfinite(_triton.sum_of_squares(group)).item()


def test_the_torch_backends_cuda_norm_takes_the_kernel_and_stays_fp32_accurate() -> None:
    _needs_triton()
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).cuda() for n in (5000, 70000)]
    grads += [torch.randn(300, generator=gen).bfloat16().cuda()]
    truth = math.sqrt(_fp64_sum_of_squares(grads))
    norm = get_kernels("torch").norm(grads, 2.0)
    assert math.isclose(norm.item(), truth, rel_tol=1e-6)
    exact = get_kernels("torch").norm(grads, 2.0, exact=True)  # torch's recipe, untouched
    assert math.isclose(exact.item(), truth, rel_tol=1e-5)


def test_non_contiguous_or_fp64_groups_take_torchs_ops() -> None:
    grads = [torch.ones(4, 4, device="cuda").t()]
    assert not _triton.usable(grads)
    assert not _triton.usable([torch.ones(3, dtype=torch.float64, device="cuda")])
    assert get_kernels("torch").norm(grads, 2.0).item() == 4.0


def test_a_fit_builds_its_chunk_tables_in_the_first_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is cached by the gradients' addresses: the caching allocator must settle on them.

    fp16 clipping reads the still-scaled gradients with ``norm(exact=False)``: the kernel's route.
    """
    _needs_triton()
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from amp_plugin import AMPPrecision

    builds: list[int] = []
    build = _triton._Plan.__init__

    def counted(self: _triton._Plan, group: list[torch.Tensor]) -> None:
        builds[-1] += 1
        build(self, group)

    monkeypatch.setattr(_triton._Plan, "__init__", counted)
    _triton._plans.clear()

    class PerBatch(Callback):
        def on_train_batch_start(self, *args: object) -> None:
            builds.append(0)

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            nn = torch.nn
            block = [nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)]
            self.net = nn.Sequential(*block, nn.Linear(64, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x = torch.randn(16 * 8, 64)
    trainer = Trainer(
        accelerator="cuda", devices=1, max_steps=16, plugins=[AMPPrecision("16-mixed")],
        callbacks=[PerBatch()], gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Model(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    assert len(builds) == 16 and sum(builds) >= 1, builds  # the kernel ran
    assert sum(builds[8:]) == 0, builds  # settled within the first half of the run



def test_a_kernel_that_fails_to_build_leaves_the_device_to_the_backends_own_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Unbuildable:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(_triton, "_kernel", lambda: Unbuildable())
    monkeypatch.setattr(_triton, "_failed", set())
    grads = [torch.full((10,), 2.0, device="cuda")]
    with pytest.warns(RuntimeWarning, match="Triton norm kernel failed on cuda.*no compiler"):
        assert get_kernels("torch").norm(grads).item() == math.sqrt(40.0)
    assert not _triton.usable(grads) and _triton.norm(grads) is None  # once: torch's read from now on


def test_another_tiling_builds_its_own_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu/norm_read.py times several tilings over the same gradients."""
    _needs_triton()
    group = [torch.randn(5 * 4096 + 3, device="cuda")]
    truth = _fp64_sum_of_squares(group)
    for chunk, block in ((16384, 1024), (4096, 512), (65536, 1024)):
        monkeypatch.setattr(_triton, "_CHUNK", chunk)
        monkeypatch.setattr(_triton, "_BLOCK", block)
        assert math.isclose(_triton.sum_of_squares(group).item(), truth, rel_tol=1e-6), chunk
