"""enable/disable_chunked_loss on tiny HF Llama models: equal loss and grads, exact restore."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn

from tightfit.loss import disable_chunked_loss, enable_chunked_loss, is_chunked_loss_enabled
from tightfit.loss.hf import predict_model_head_loss_bytes

V = 211


def tiny_llama(tied: bool = False) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, 19))
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    return ids, labels


def loss_and_grads(model: nn.Module, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_grads_equal(got: dict, ref: dict, rtol: float) -> None:
    assert got.keys() == ref.keys() and ref
    for name, g in ref.items():
        err = ((got[name] - g).double().norm() / g.double().norm().clamp_min(1e-30)).item()
        assert err <= rtol, (name, err)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_model_loss_and_grads_equal_hf(tied):
    model = tiny_llama(tied)
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(model, ids, labels)
    enable_chunked_loss(model, 7)
    assert is_chunked_loss_enabled(model)
    got, got_grads = loss_and_grads(model, ids, labels)
    assert got.logits is None  # documented: the full logits are what we never build
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-6 * abs(ref.loss.item())
    assert_grads_equal(got_grads, ref_grads, 1e-6)
    # positional input_ids, tuple output, num_items_in_batch passed through like HF's Trainer
    as_tuple = model(ids, labels=labels, return_dict=False, num_items_in_batch=torch.tensor(20))
    disable_chunked_loss(model)
    hf = model(ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss
    assert abs(as_tuple[0].item() - hf.item()) <= 1e-6 * abs(hf.item())


def test_disable_restores_the_model_exactly():
    model = tiny_llama()
    ids, labels = batch()
    before = model(input_ids=ids, labels=labels)
    class_forward = type(model).forward
    enable_chunked_loss(model, "auto")
    # without labels the original forward runs: logits unchanged
    assert torch.equal(model(input_ids=ids).logits, before.logits)
    enable_chunked_loss(model, 5)  # again: replaces the settings, not stacked
    disable_chunked_loss(model)
    assert "forward" not in model.__dict__ and not is_chunked_loss_enabled(model)
    assert model.forward.__func__ is class_forward
    after = model(input_ids=ids, labels=labels)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    disable_chunked_loss(model)  # a no-op when off


def test_an_existing_instance_forward_is_put_back():
    model = tiny_llama()
    marker = model.forward  # e.g. an accelerate hook stores an instance-level forward
    model.forward = marker
    enable_chunked_loss(model, 4)
    assert model.forward is not marker
    disable_chunked_loss(model)
    assert model.__dict__["forward"] is marker


def linear4bit_like(linear: nn.Linear) -> bnb.nn.Linear4bit:
    q = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.float32,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    q.weight = bnb.nn.Params4bit(
        linear.weight.data.contiguous(),
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
    ).to("cpu")  # quantizes (NF4 + double quant) on the move, on the CPU too
    return q


def test_4bit_lora_peft_model_loss_and_lora_grads_equal_hf():
    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.q_proj = linear4bit_like(layer.self_attn.q_proj)
        layer.self_attn.v_proj = linear4bit_like(layer.self_attn.v_proj)
    model.lm_head = linear4bit_like(model.lm_head)  # a 4-bit head, LoRA on top of it
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    peft_model = get_peft_model(model, config)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapters do something
            nn.init.normal_(p, std=0.05)
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(peft_model, ids, labels)
    assert any("lm_head" in n for n in ref_grads) and all("lora_" in n for n in ref_grads)
    enable_chunked_loss(peft_model, 6)
    got, got_grads = loss_and_grads(peft_model, ids, labels)
    assert got.logits is None
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-6 * abs(ref.loss.item())
    assert_grads_equal(got_grads, ref_grads, 1e-6)
    disable_chunked_loss(peft_model)
    assert "forward" not in peft_model.get_base_model().__dict__


def test_all_labels_ignored_through_the_model_gives_hf_result():
    model = tiny_llama()
    ids, labels = batch()
    labels[:] = -100
    ref, ref_grads = loss_and_grads(model, ids, labels)
    enable_chunked_loss(model, 8)
    got, got_grads = loss_and_grads(model, ids, labels)
    assert torch.isnan(ref.loss) and torch.isnan(got.loss)  # HF: mean over zero tokens
    for name, g in ref_grads.items():
        assert torch.equal(got_grads[name], g), name  # all zero, no NaN


def test_auto_with_budget_and_prediction_for_a_model():
    model = tiny_llama()
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels).loss
    enable_chunked_loss(model, budget=V * 4 * 3)  # three fp32 tokens' logits per chunk
    assert abs(model(input_ids=ids, labels=labels).loss.item() - ref.item()) <= 1e-6 * ref.item()
    chunked = predict_model_head_loss_bytes(model, batch=2, seq_len=19, budget=V * 4 * 3)
    unchunked = predict_model_head_loss_bytes(model, batch=2, seq_len=19, chunk_tokens=None)
    assert 0 < chunked < unchunked


def test_bad_input_is_refused_before_any_change():
    model = tiny_llama()
    with pytest.raises(ValueError, match="chunk_tokens"):
        enable_chunked_loss(model, 0)
    with pytest.raises(ValueError, match="budget only applies"):
        enable_chunked_loss(model, 8, budget=1 << 20)
    with pytest.raises(TypeError, match="causal LM"):
        enable_chunked_loss(nn.Linear(3, 3))
    model.config.final_logit_softcapping = 30.0  # Gemma-2 style: logits transformed first
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        enable_chunked_loss(model)
    assert "forward" not in model.__dict__ and not is_chunked_loss_enabled(model)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_other_layouts_backbone_prefix_and_head_name(arch):
    # GPT-2: backbone `transformer`; GPT-NeoX: backbone `gpt_neox`, head `embed_out`
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.GPTNeoXConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=32,
        )
        model = transformers.GPTNeoXForCausalLM(config)
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(model, ids, labels)
    enable_chunked_loss(model, 9)
    got, got_grads = loss_and_grads(model, ids, labels)
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-6 * abs(ref.loss.item())
    assert_grads_equal(got_grads, ref_grads, 1e-6)
