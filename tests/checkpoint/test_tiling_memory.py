"""Tiled MLPs' bytes: predicted beside measured, bounded by the tile; attention is not T×T."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit.checkpoint as ck
from tightfit.checkpoint.tile_cost import predict_mlp_bytes
from tightfit.checkpoint.tiling import disable_tiling, enable_tiling
from tightfit.measure.tracker import MemoryTracker
from tightfit.qlora.quantize import quantize_linears

from . import tiled
from .conftest import tiny_llama


class _Holder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def _measured_mlp(hidden: int, intermediate: int, tokens: int, tile: int | None, dtype,
                  rank: int, dropout: float, base: str) -> dict[str, int]:
    """MemoryTracker around ``y = mlp(x); y.backward(g)`` for an MLP built as ``base``."""
    torch.manual_seed(0)
    holder = _Holder(tiled.mlp(hidden, intermediate))
    if base == "4bit":
        holder.requires_grad_(False)
        quantize_linears(holder, compute_dtype=dtype)
    else:
        holder.to(dtype).requires_grad_(base == "trainable")
    if rank:  # fp32 adapters, as peft makes them over a 16-bit base
        holder = get_peft_model(holder, LoraConfig(r=rank, lora_dropout=dropout, target_modules=[
            "gate_proj", "up_proj", "down_proj"])).base_model.model
    mlp = holder.mlp.train()
    if tile is not None:
        tiled.tile_one(mlp, tile)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, hidden, dtype=dtype)
    with MemoryTracker("cpu") as mt:
        y = mlp(x)
        mt.mark("backward")
        y.backward(g)
    saved = mt.phases[0].end_bytes - y.untyped_storage().nbytes()
    return {"forward": mt.phase_peaks["forward"], "backward": mt.phase_peaks["backward"],
            "saved": saved}


# Shapes and tiles the coefficients were not fitted on (tile_cost's docstring has the grid).
HELD_OUT = [  # (base, rank, dropout, dtype)
    ("frozen", 12, 0.1, torch.float32), ("4bit", 12, 0.0, torch.bfloat16),
    ("4bit", 12, 0.1, torch.float32), ("frozen", 0, 0.0, torch.bfloat16),
    ("trainable", 0, 0.0, torch.float32),
]


@pytest.mark.parametrize("kind", HELD_OUT, ids=lambda k: f"{k[0]}-r{k[1]}-p{k[2]}-{k[3]}")
def test_predicted_bytes_within_10_percent_and_tiling_saves_what_it_predicts(kind) -> None:
    base, rank, dropout, dtype = kind
    hidden, inter, tokens = 80, 272, 300
    measured = {}
    for tile in (None, 40, 120):
        m = _measured_mlp(hidden, inter, tokens, tile, dtype, rank, dropout, base)
        p = predict_mlp_bytes(tokens, hidden, inter, dtype, tile=tile, lora_rank=rank,
                              lora_dropout=dropout, base=base)
        assert abs(p.forward_peak_bytes / m["forward"] - 1) <= 0.1, (tile, p, m)
        assert abs(p.backward_peak_bytes / m["backward"] - 1) <= 0.1, (tile, p, m)
        assert abs(p.saved_bytes - m["saved"]) <= 0.1 * max(m["saved"], 1), (tile, p, m)
        measured[tile] = (max(m["forward"], m["backward"]), p.peak_bytes)
    for tile in (40, 120):
        saving, predicted_saving = (measured[None][i] - measured[tile][i] for i in (0, 1))
        assert saving > 0 and abs(saving / predicted_saving - 1) <= 0.1, (tile, measured)
    assert measured[40][0] < measured[120][0]  # a smaller tile, a smaller peak


def test_prediction_refuses_bad_input() -> None:
    ok = {"tokens": 8, "hidden": 4, "intermediate": 8, "dtype": torch.float32}
    for bad, match in [({"tokens": 0}, "tokens must be"), ({"tile": 0}, "tile must be"),
                       ({"dtype": torch.int8}, "dtype must be"), ({"base": "8bit"}, "base must"),
                       ({"base": "trainable", "lora_rank": 4}, "not modelled"),
                       ({"lora_dropout": 0.1}, "needs lora_rank")]:
        with pytest.raises(ValueError, match=match):
            predict_mlp_bytes(**{**ok, **bad})


def _layer_backward_transients(model: nn.Module, seq: int) -> list[int]:
    prof = ck.profile(model, tiled.batch(seq=seq, size=1), repeats=1)
    return [b.bwd_peak_bytes - b.bwd_start_bytes for b in prof.blocks]


def test_layer_backward_transient_is_bounded_by_the_tile() -> None:
    # intermediate = 64 × hidden, so one t×I row outweighs every O(T·hidden) term of a layer
    hidden, inter = 32, 2048
    model = tiled.lora(LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)), 0.0)
    untiled = [_layer_backward_transients(model, s) for s in (64, 128)]
    enable_tiling(model, 16)
    try:
        tiled_t = [_layer_backward_transients(model, s) for s in (64, 128)]
    finally:
        disable_tiling(model)
    per_token = 4 * hidden  # fp32 bytes of one hidden row
    for layer in range(2):
        grow_untiled = (untiled[1][layer] - untiled[0][layer]) / 64
        grow_tiled = (tiled_t[1][layer] - tiled_t[0][layer]) / 64
        assert grow_untiled >= 4 * inter  # at least one fp32 T×I tensor more per token
        assert grow_tiled <= 24 * per_token  # only O(T·hidden) terms grow
        assert tiled_t[1][layer] < untiled[0][layer]  # and 2T tiled < T untiled


def test_checkpoint_plan_of_a_tiled_model_predicts_its_peak() -> None:
    # profile() measures the model as it runs, tiles included: the planner's prediction holds
    torch.manual_seed(0)
    model = tiled.lora(tiny_llama(layers=4, hidden=32), dropout=0.0)
    batch = tiled.batch(seq=96, size=1)
    enable_tiling(model, 16)
    try:
        plan = ck.enable(model, "every", example=batch)
        model.zero_grad(set_to_none=True)
        with MemoryTracker("cpu") as mt:
            model(**batch).loss.backward()
    finally:
        ck.disable(model)
        disable_tiling(model)
    assert 0.9 * plan.predicted_peak_bytes <= mt.peak_bytes <= 1.1 * plan.predicted_peak_bytes


# -- attention: nothing T×T ----------------------------------------------------------------

class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def test_sdpa_attention_builds_nothing_t_by_t() -> None:
    # HF's "sdpa" attention on the CPU, no padding: the model passes no mask (an all-ones one
    # is dropped), SDPA runs causal through torch's CPU flash kernel, and the bytes of the
    # attention's forward + backward grow linearly in T. A T×T fp32 score matrix per head
    # would add 4 heads × 4 B × T² (4 MiB at T = 512) on top.
    model = tiny_llama(layers=1, hidden=64)
    attn = model.model.layers[0].self_attn
    seen: dict = {}
    hook = attn.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    peaks = []
    try:
        for seq in (256, 512):
            ids = torch.randint(0, 128, (1, seq))
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
            assert seen["attention_mask"] is None
            x = torch.randn(1, seq, 64, requires_grad=True)
            rope = tuple(t.detach() for t in seen["position_embeddings"])
            with MemoryTracker("cpu") as mt, _Ops() as ops:
                attn(x, position_embeddings=rope, attention_mask=None)[0].sum().backward()
            assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops.names
            peaks.append(mt.peak_bytes)
    finally:
        hook.remove()
    assert 1.9 * peaks[0] <= peaks[1] <= 2.1 * peaks[0]
    assert peaks[1] < 4 * 4 * 512 * 512


def test_notes_name_what_tiling_does_not_bound() -> None:
    model = tiny_llama(layers=2, dropout=0.1)  # attention_dropout: SDPA's math kernel on CPU
    assert any("T×T" in n for n in enable_tiling(model).notes)
    disable_tiling(model)
    model.config._attn_implementation = "eager"
    assert any("eager" in n for n in enable_tiling(model).notes)
    disable_tiling(model)
    assert enable_tiling(tiny_llama(layers=2)).notes == ()
