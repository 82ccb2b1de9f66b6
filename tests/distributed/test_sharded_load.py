"""--fsdp's loading refuses, before a weight is read, what it cannot shard (which and why)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MixtralConfig

from tightfit.distributed.parallelize import unshardable
from tightfit.distributed.sharded_load import load_sharded, source_key
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions

pytestmark = pytest.mark.distributed


def _unreadable_weights(folder, config) -> None:
    """A model folder whose config is fine and whose weights file is garbage: anything
    that reads a weight fails, so a refusal that comes first read none."""
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")


def _load(folder, lora=None, **options):
    return load_sharded(folder, PrepareOptions(checkpoint=None, **options), lora=lora,
                        example=None, device=torch.device("cpu"))  # fmt: skip


def test_moe_experts_in_4_bits_are_refused_before_any_weight(tmp_path) -> None:
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                        num_experts_per_tok=1)  # fmt: skip
    _unreadable_weights(tmp_path, cfg)
    with pytest.raises(ValueError, match=r"--fsdp cannot shard this model's MoE experts .*"
                                         r"without --fsdp, or with --quant none"):
        _load(tmp_path, LoraOptions(r=2))


def test_lora_targets_that_match_nothing_are_refused_before_any_weight(tmp_path) -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    _unreadable_weights(tmp_path, cfg)
    with pytest.raises(ValueError, match=r"match no linear layer; .*q_proj"):
        _load(tmp_path, LoraOptions(r=2, target_modules=("qkv",)))
    seen = []

    def too_long(meta_model: nn.Module) -> None:  # the caller's check (--seq-len, vocabulary)
        seen.append(next(meta_model.parameters()).device.type)
        raise ValueError("too long")

    with pytest.raises(ValueError, match="too long"):
        load_sharded(tmp_path, PrepareOptions(checkpoint=None), lora=None, example=None,
                     device=torch.device("cpu"), check=too_long)
    assert seen == ["meta"]


def test_a_folder_without_safetensors_is_refused(tmp_path) -> None:
    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        _load(tmp_path)


def test_unshardable_names_the_parameter() -> None:
    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.0))
    assert "cannot shard scale: a 0-dim parameter" in (unshardable(model) or "")
    assert unshardable(nn.Linear(2, 2)) is None


def test_source_keys_drop_peft_prefixes() -> None:
    assert source_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") \
        == "model.layers.0.self_attn.q_proj.weight"  # fmt: skip
    assert source_key("base_model.model.lm_head.weight") == "lm_head.weight"
