"""Half-precision weights on a real Hugging Face model: a tiny random-init Llama (no downloads).

Skipped without ``transformers``. The Llama's ``LlamaRMSNorm`` is no torch norm class and its rotary
``inv_freq`` is a non-persistent buffer: under O2 both must stay fp32.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from amp_plugin import AMPPrecision

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

O2: dict[str, Any] = {"precision": "16-mixed", "master_weights": True}  # what from_opt_level("O2") gives
BF16_STOCHASTIC: dict[str, Any] = {"precision": "bf16-true", "rounding": "stochastic", "rounding_seed": 7}


class TinyLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128,
        )  # fmt: skip
        self.llama = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.llama(input_ids=tokens, labels=tokens).loss.float()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _tokens() -> torch.utils.data.DataLoader:
    tokens = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


def _fit(
    kwargs: dict[str, Any], epochs: int, ckpt_dir: Path | None = None, ckpt_path: Path | None = None
) -> tuple[TinyLlama, L.Trainer]:
    module = TinyLlama()
    plugin = AMPPrecision.from_opt_level("O2") if kwargs is O2 else AMPPrecision(**kwargs)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True)] if ckpt_dir else []
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(ckpt_dir), callbacks=callbacks)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _tokens(), ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("kwargs", [O2, BF16_STOCHASTIC], ids=["O2", "bf16-true-stochastic"])
def test_a_llama_trains_and_resumes_bit_exactly(kwargs: dict[str, Any], tmp_path: Path) -> None:
    uninterrupted, _ = _fit(kwargs, 2)
    _, first = _fit(kwargs, 1, ckpt_dir=tmp_path)
    first.save_checkpoint(tmp_path / "after_fit.ckpt")
    for ckpt in ("last.ckpt", "after_fit.ckpt"):
        resumed, _ = _fit(kwargs, 2, ckpt_path=tmp_path / ckpt)
        assert all(torch.isfinite(p).all() for p in resumed.parameters())
        for (name, a), b in zip(uninterrupted.named_parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b), (ckpt, name)


def test_o2_keeps_rmsnorm_and_inv_freq_fp32_and_saves_the_fp32_masters(tmp_path: Path) -> None:
    module, trainer = _fit(O2, 1)
    llama = module.llama
    assert llama.model.embed_tokens.weight.dtype == torch.float16
    assert llama.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    norms = [m for m in llama.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5 and all(m.weight.dtype == torch.float32 for m in norms)
    assert llama.model.rotary_emb.inv_freq.dtype == torch.float32
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AMPPrecision) and plugin.masters is not None
    trainable = [p for p in module.parameters() if p.dtype == torch.float16]
    assert len(plugin.masters) == len(trainable)
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    state = torch.load(tmp_path / "weights.ckpt", weights_only=False)["state_dict"]
    q_proj = state["llama.model.layers.0.self_attn.q_proj.weight"]
    master = plugin.masters.master_of(llama.model.layers[0].self_attn.q_proj.weight)
    assert q_proj.dtype == torch.float32 and master is not None and torch.equal(q_proj, master)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    TinyLlama().load_state_dict(state)  # an ordinary fp32 checkpoint
