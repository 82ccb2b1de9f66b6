"""Tiny models of the families whose MLPs tile as MoE experts or a fused gate_up (from configs)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

V = 128
MOE = ["mixtral", "qwen3_moe", "gpt_oss"]
FAMILIES = [*MOE, "phi3"]


def tiny(family: str, **kw) -> nn.Module:
    """A 2-layer ``family`` model (``kw`` overrides config fields), fp32, in train mode."""
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2)
    if family == "mixtral":
        cls, config = MixtralForCausalLM, MixtralConfig
        cfg |= moe | dict(intermediate_size=96, num_local_experts=4)
    elif family == "qwen3_moe":
        cls, config = Qwen3MoeForCausalLM, Qwen3MoeConfig
        cfg |= moe | dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                          head_dim=16)
    elif family == "gpt_oss":
        cls, config = GptOssForCausalLM, GptOssConfig
        cfg |= moe | dict(intermediate_size=64, num_local_experts=4, head_dim=16)
    else:
        cls, config = Phi3ForCausalLM, Phi3Config
        cfg |= dict(intermediate_size=112, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = cls(config(**(cfg | kw)))
    for name, p in model.named_parameters():  # gpt-oss initializes these to zero
        if name.endswith(("_bias", "router.bias", "sinks")):
            nn.init.normal_(p, std=0.1)
    return model.train()


def batch(seq: int = 24, size: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (size, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).double().norm() / b.double().norm().clamp_min(1e-30)).item()
