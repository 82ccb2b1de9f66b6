"""A prepared 4-bit model's state dict loads back (issue 16, item 8): strictly and exactly,
quant state included, and through accelerate's ``save_state``/``load_state``, which resumes a
run with a paged optimizer bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.qlora.quantize import linear4bit_layers
from tightfit.qlora.saved_quant_state import take_saved_quant_state

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
           tie_word_embeddings=False)  # fmt: skip


def _prepared(seed: int, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tightfit.prepare(LlamaForCausalLM(LlamaConfig(**CFG)), checkpoint=None,
                            loss_chunks=16, lora={"r": 4, "alpha": 8}, device="cpu", **kw)


def test_a_prepared_model_loads_its_own_state_dict_exactly() -> None:
    saved, other = _prepared(0), _prepared(1)  # other: another base, quantized differently
    assert all(layer._tightfit_takes_quant_state for _, layer in linear4bit_layers(saved))
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        want = saved(input_ids=ids).logits
        assert not torch.equal(other(input_ids=ids).logits, want)
    sd = saved.state_dict()
    assert any(k.endswith("weight.absmax") for k in sd)
    result = other.load_state_dict(sd)  # strict: no unexpected quant-state keys
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, want)
    for (k, a), b in zip(sd.items(), other.state_dict().values()):
        assert torch.equal(a, b), k


def test_other_quantization_settings_are_refused_by_name() -> None:
    sd = _prepared(0).state_dict()
    other = _prepared(0, blocksize=128)
    with pytest.raises(RuntimeError, match="prepare the model with the saved quantization"):
        other.load_state_dict(sd)
    with pytest.raises(TypeError, match="expected a bitsandbytes Linear4bit"):
        take_saved_quant_state(torch.nn.Linear(2, 2))


def test_accelerate_save_state_and_load_state_resume_exactly(tmp_path) -> None:
    accelerate = pytest.importorskip("accelerate")
    model = _prepared(0)
    opt = tightfit.optimizer_for(model, kind="paged_adamw", lr=1e-2, page_bytes=4096,
                                 device_budget=4096, spill_dir=tmp_path / "spill")  # fmt: skip
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(5)]

    def train(steps: list[torch.Tensor]) -> None:
        for ids in steps:
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()

    train(batches[:3])
    acc.save_state(str(tmp_path / "state"))
    train(batches[3:])
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    acc.load_state(str(tmp_path / "state"))  # model (4-bit base + LoRA) and optimizer
    train(batches[3:])
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, want[n]), n
    opt.optimizer.close()
