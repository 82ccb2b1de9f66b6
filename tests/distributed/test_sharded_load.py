"""--fsdp's loading refuses, before a weight is read, what it cannot shard (which and why)."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig

from tightfit.distributed.parallelize import shard_model, unshardable
from tightfit.distributed.sharded_load import load_sharded, source_key
from tightfit.qlora.lora_compute import CastLinear
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.qlora.quantize import quantize_linears
from tightfit.qlora.shardable import ShardableLinear4bit

pytestmark = pytest.mark.distributed


def _unreadable_weights(folder, config) -> None:
    """A model folder whose config is fine and whose weights file is garbage: anything
    that reads a weight fails, so a refusal that comes first read none."""
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")


TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def one_rank():
    """A one-rank gloo group (a HashStore: no port), for load_sharded/shard_model in-process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny_folder(folder) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _load(folder, lora=None, **options):
    return load_sharded(folder, PrepareOptions(checkpoint=None, **options), lora=lora,
                        example=None, device=torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["nf4", None])
def test_moe_experts_are_refused_before_any_weight(tmp_path, family, quant) -> None:
    # the checkpoint's per-expert keys (block_sparse_moe.experts.0.w1 ...) are fused into 3-D
    # stacks by transformers as it loads; the shard-by-shard loader does not do that
    from transformers import Qwen3MoeConfig

    common = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 1}
    cfg = (MixtralConfig(intermediate_size=64, num_local_experts=2, **common)
           if family == "mixtral" else
           Qwen3MoeConfig(moe_intermediate_size=16, num_experts=2, **common))  # fmt: skip
    _unreadable_weights(tmp_path, cfg)
    why = "its 4-bit expert stacks keep their constants as buffers" if quant else "transformers"
    with pytest.raises(ValueError, match=rf"--fsdp cannot load this model's MoE experts "
                                         rf"\(model\.layers\.0\.mlp\.experts, .*{why}.*"
                                         rf"train it without --fsdp"):
        _load(tmp_path, LoraOptions(r=2), quant=quant)


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


def test_explicit_resident_layers_are_refused_before_any_weight(tmp_path) -> None:
    _unreadable_weights(tmp_path, LlamaConfig(**TINY))
    with pytest.raises(ValueError, match=r"--resident-layers 1 cannot apply under --fsdp: "
                                         r"FSDP2 shards .* not supported under --fsdp; drop"):
        _load(tmp_path, LoraOptions(r=2), resident_layers=1)


def test_adapters_compute_in_the_compute_dtype_as_prepare_does(tmp_path, one_rank) -> None:
    _tiny_folder(tmp_path)
    model = _load(tmp_path, LoraOptions(r=2))  # LoRA's default compute: compute_dtype
    casts = [n for n, m in model.named_modules() if isinstance(m, CastLinear)]
    assert casts and all(".lora_A." in n or ".lora_B." in n for n in casts)
    peft_own = _load(tmp_path, LoraOptions(r=2, compute="lora_dtype"))
    assert not any(isinstance(m, CastLinear) for m in peft_own.modules())


def test_no_adapters_and_no_quant_trains_the_loaded_base(tmp_path, one_rank) -> None:
    ref = _tiny_folder(tmp_path)
    model = _load(tmp_path, None, quant=None)
    params = dict(model.named_parameters())
    assert params and all(p.requires_grad for p in params.values())
    for name, p in ref.named_parameters():  # the trainable base is read, not left empty
        assert torch.equal(params[name].full_tensor(), p.detach()), name
    quantized = _load(tmp_path, None)  # 4 bits, no adapters: nothing trains (as prepare)
    assert not any(p.requires_grad for p in quantized.parameters())


def test_a_refused_model_is_left_unchanged(one_rank) -> None:
    model = nn.Sequential(nn.Linear(64, 32))
    quantize_linears(model)
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="cannot shard scale: a 0-dim parameter"):
        shard_model(model, "fsdp")
    assert type(model[0]) is bnb.nn.Linear4bit and not isinstance(model[0], ShardableLinear4bit)
    assert type(model[0].weight).__name__ == "Params4bit"
    assert unshardable(model) is not None  # an unconverted Params4bit is refused unless
    assert unshardable(model, converting=True) is not None  # converting (the scale still is)
    del model.scale
    assert unshardable(model, converting=True) is None
