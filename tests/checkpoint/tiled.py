"""Helpers of the tiling tests: tiny MLPs and batches, LoRA wrapping, one tiled MLP."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from tightfit.checkpoint.tiling import tiled_forward_for


def batch(seq: int = 13, size: int = 2) -> dict:
    x = torch.randint(0, 128, (size, seq))
    return {"input_ids": x, "labels": x}


def mlp(hidden: int, intermediate: int) -> LlamaMLP:
    return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                                num_attention_heads=4, num_key_value_heads=2))


def lora(model: nn.Module, dropout: float) -> nn.Module:
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear",
                                            lora_dropout=dropout))


def tile_one(module: nn.Module, tile: int) -> None:
    """Tile one MLP module directly (what enable_tiling does to each block's MLP)."""
    module.forward = tiled_forward_for(module, module.forward, tile)
