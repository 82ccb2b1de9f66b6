"""Tiled MoE experts and Phi-3's fused MLP: measured bytes fall with the tile; the fused
MLP's prediction (tile_cost) within 10 % of the tracker on a shape it was not fitted on."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3MLP

import tightfit
from tightfit.checkpoint.tile_cost import predict_mlp_bytes
from tightfit.checkpoint.tiling import disable_tiling, enable_tiling, tiled_forward_for
from tightfit.measure.tracker import MemoryTracker
from tightfit.qlora.quantize import quantize_linears

from .families import tiny


class _Holder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def _tracked(mlp: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """MemoryTracker around ``y = mlp(x); y.backward(g)`` (gpt-oss' block returns a tuple)."""
    g = torch.randn_like(x)
    with MemoryTracker("cpu") as mt:
        y = mlp(x)
        y = y[0] if isinstance(y, tuple) else y
        mt.mark("backward")
        y.backward(g)
    return mt.phase_peaks


def _fused_measured(hidden: int, inter: int, tokens: int, tile: int, dtype: torch.dtype,
                    rank: int, dropout: float, base: str) -> dict[str, int]:
    torch.manual_seed(0)
    holder = _Holder(Phi3MLP(Phi3Config(hidden_size=hidden, intermediate_size=inter,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        pad_token_id=0)))
    if base == "4bit":
        holder.requires_grad_(False)
        quantize_linears(holder, compute_dtype=dtype)
    else:
        holder.to(dtype).requires_grad_(base == "trainable")
    if rank:  # fp32 adapters, as peft makes them over a 16-bit base
        holder = get_peft_model(holder, LoraConfig(r=rank, lora_dropout=dropout, target_modules=[
            "gate_up_proj", "down_proj"])).base_model.model
    mlp = holder.mlp.train()
    mlp.forward = tiled_forward_for(mlp, mlp.forward, tile)
    return _tracked(mlp, torch.randn(tokens, hidden, dtype=dtype, requires_grad=True))


# tile_cost's fused tables were fitted on H 64/128, I 224/352, N 256/384 (4-bit moment: H
# 192/256, I 384/512); these are other shapes and tiles
HELD_OUT = [("frozen", 12, 0.1, torch.float32), ("4bit", 12, 0.0, torch.bfloat16),
            ("4bit", 12, 0.1, torch.float32), ("frozen", 0, 0.0, torch.bfloat16),
            ("trainable", 0, 0.0, torch.float32), ("4bit", 8, 0.0, torch.float32)]


@pytest.mark.parametrize("kind", HELD_OUT, ids=lambda k: f"{k[0]}-r{k[1]}-p{k[2]}-{k[3]}")
def test_fused_mlp_prediction_within_10_percent(kind) -> None:
    base, rank, dropout, dtype = kind
    peaks = []
    for hidden, inter, tokens, tile in ((80, 272, 300, 40), (80, 272, 300, 120),
                                        (160, 448, 200, 48)):
        m = _fused_measured(hidden, inter, tokens, tile, dtype, rank, dropout, base)
        p = predict_mlp_bytes(tokens, hidden, inter, dtype, tile=tile, lora_rank=rank,
                              lora_dropout=dropout, base=base, fused=True)
        assert abs(p.forward_peak_bytes / m["forward"] - 1) <= 0.1, (tile, p, m)
        assert abs(p.backward_peak_bytes / m["backward"] - 1) <= 0.1, (tile, p, m)
        peaks.append(max(m.values()))
    assert peaks[0] < peaks[1]  # a smaller tile, a smaller peak
    with pytest.raises(ValueError, match="untiled fused gate_up MLP is not modelled"):
        predict_mlp_bytes(300, 80, 272, dtype, fused=True)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_block_transient_falls_with_the_tile(family: str) -> None:
    # NF4 experts with LoRA (prepare); routers zeroed: every token at the same k experts,
    # the worst case (an expert gets all of a tile's tokens)
    model = tiny(family, hidden_size=64, num_hidden_layers=2)
    for name, p in model.named_parameters():
        if "router" in name or ".gate.weight" in name:
            nn.init.zeros_(p)
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None, lora={"r": 4, "dropout": 0.0})
    block = pm.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 256, 64, requires_grad=True)
    peaks = {}
    for tile in (None, 128, 32):
        if tile is not None:
            enable_tiling(pm, tile)
        peaks[tile] = _tracked(block, x)
        disable_tiling(pm)
    for phase in ("forward", "backward"):
        assert peaks[32][phase] < peaks[128][phase] < peaks[None][phase], (phase, peaks)
    assert peaks[32]["forward"] < peaks[None]["forward"] / 3
