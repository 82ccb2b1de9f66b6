"""ShardableLinear4bit: the same bits as bitsandbytes' Linear4bit, and the loader's meta
shapes are the ones bitsandbytes' quantization gives (odd sizes and partial blocks too)."""

from __future__ import annotations

import copy

import bitsandbytes as bnb
import pytest
import torch

from tightfit.qlora.quantize import (
    layer_quant_state,
    linear4bit_skeleton,
    quantizable_linears,
    quantize_linears,
)
from tightfit.qlora.shardable import (
    BASE_PIECES,
    REPLICATED_BYTES,
    ShardableLinear4bit,
    base_parameters,
    empty_shardable,
    make_shardable,
)

CASES = [(128, 96, "nf4", True), (35, 33, "nf4", True), (70, 33, "fp4", False), (64, 40, "fp4", True)]


def _quantized(in_f: int, out_f: int, quant: str, dq: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f))
    quantize_linears(model, quant_type=quant, double_quant=dq)
    return model


@pytest.mark.parametrize(("in_f", "out_f", "quant", "dq"), CASES)
def test_same_forward_and_backward_bits_as_linear4bit(in_f, out_f, quant, dq) -> None:
    ref = _quantized(in_f, out_f, quant, dq)
    mine = copy.deepcopy(ref)
    layer = make_shardable(mine[0])
    assert isinstance(layer, ShardableLinear4bit) and "weight" in layer._parameters
    assert all(not p.requires_grad for p in base_parameters(mine))
    assert {n.split(".")[-1] for n, _ in mine.named_parameters()} >= {"weight", "absmax"}
    x = torch.randn(5, in_f, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y_ref, y = ref(x), mine(x2)
    assert torch.equal(y_ref, y)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    codes, qs = layer_quant_state(layer)
    ref_codes, ref_qs = layer_quant_state(ref[0])
    assert torch.equal(codes, ref_codes) and torch.equal(qs.absmax, ref_qs.absmax)
    assert torch.equal(layer.dequantized(),
                       bnb.functional.dequantize_4bit(ref_codes, ref_qs))  # fmt: skip


@pytest.mark.parametrize(("in_f", "out_f", "quant", "dq"), CASES)
def test_meta_shapes_are_bitsandbytes_shapes(in_f, out_f, quant, dq) -> None:
    real = make_shardable(_quantized(in_f, out_f, quant, dq)[0])
    with torch.device("meta"):
        skeleton = torch.nn.Sequential(torch.nn.Linear(in_f, out_f))
    linear4bit_skeleton(skeleton, quant_type=quant, double_quant=dq)
    meta = empty_shardable(skeleton[0], blocksize=64)
    for piece in BASE_PIECES:
        a, b = real._parameters.get(piece), meta._parameters.get(piece)
        assert (a is None) == (b is None), piece
        if a is not None:
            assert (a.shape, a.dtype) == (b.shape, b.dtype) and b.is_meta, piece
    assert (meta.shape, meta.nested, meta.quant_type) == (real.shape, real.nested, real.quant_type)
    replicated = sum(b.numel() * b.element_size() for b in real.buffers())
    assert replicated == (REPLICATED_BYTES if dq else 16 * 4)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_one_process_and_sharded_loading_quantize_the_same_layers_in_order(kind) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def build() -> torch.nn.Module:
        if kind == "gpt2":  # Conv1D layers, a head tied to the embedding
            return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, tie_word_embeddings=False))

    listed = [full for full, *_ in quantizable_linears(build())]
    assert listed and not any("lm_head" in n for n in listed)
    assert quantize_linears(build()) == listed
    with torch.device("meta"):
        meta = build()
    assert linear4bit_skeleton(meta) == listed
