"""What a mixture-of-experts layer saves and holds in backward (Mixtral, Qwen3-MoE).

Each token goes to its top-k experts, so an MoE MLP works on T·k routed (token, slot) pairs;
what it saves scales with the pairs, not with the number of experts E. Counted from the two
forwards (tightfit's 4-bit experts, :mod:`tightfit.qlora.experts`, and transformers' own for
unquantized experts with peft's parameter LoRA), with the tensors autograd saves listed on
small configs; the few bytes per token and per pair of routing indices were fitted there.
Symbols: P = T·k pairs, I an expert's intermediate size, h hidden, d / a bytes of the compute
/ adapter dtype, r the LoRA rank.

* 4-bit experts, per pair: the gate/up output (2I), its activation (I) and the down
  projection's input (I) and output (h) and the gathered input (h): (3I + 2h)·d, plus
  ``ROUTE_PAIR`` bytes of indices; a LoRA on an expert weight adds its input in the adapter
  dtype and its r-wide hidden, (h + r)·a for gate/up and (I + r)·a for down.
* unquantized experts, per pair: (3I + h)·d (a frozen full-precision matmul keeps no input);
  with a LoRA, peft's ``ParamWrapper`` adds the adapter to the weight itself, so every
  expert's merged weight is saved (E·in·out·d per adapted weight) and the inputs too.
* the router: its fp32 softmax over E experts (4·E per token) and ``ROUTE_TOKEN`` bytes per
  token of top-k values and indices.
* backward: one expert's projection dequantized (in·out·d) beside its tokens' gradients.
  How many tokens one expert gets depends on the data; the planner assumes the worst case,
  all T tokens at one expert (top-k experts are distinct, so no more than T) — each token
  at the same k experts, T tokens each, which is what ``--verify`` measures (routers
  zeroed). A recomputed layer (NF4, adapters in the compute dtype) peaks at its last
  expert, in its recomputed forward or in its backward (:func:`expert_moments`, listed with
  the tracker); the other setups keep the calibrated :func:`expert_backward_bytes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit.measure.dtypes import DTYPE_BYTES

if TYPE_CHECKING:
    from tightfit.planner.shapes import ModelShape
    from tightfit.planner.train_setup import TrainSetup

# Fitted on small Mixtral configs (fp32 and bf16, k = 2 and 3, E = 4 and 8; the list of
# saved tensors: int64 sort order and token / slot indices, top-k values): bytes per pair and
# per token beside the counted terms. Held out: tests/planner/test_families.py.
ROUTE_PAIR = 32
ROUTE_TOKEN = 68


def _route_bytes(shape: ModelShape, tokens: int) -> int:
    """What the router saves for ``tokens`` tokens (its fp32 softmax, top-k values and indices)."""
    return tokens * (4 * shape.experts + ROUTE_TOKEN)


def tiled_expert_saved_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """What one MoE MLP saves with its experts tiled (:mod:`tightfit.checkpoint.tiling`):
    the router's (it runs untiled) and the tiled experts' inputs, the hidden states (T·h·d),
    each token's top-k indices (int64) and routing weights (fp32 at most)."""
    k = shape.experts_per_token
    return _route_bytes(shape, tokens) + tokens * (shape.hidden * setup.d + k * (8 + 4))


def expert_saved_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """What one MoE MLP (experts + router) saves for ``tokens`` tokens."""
    h, i, d = shape.hidden, shape.intermediate, setup.d
    pairs = tokens * shape.experts_per_token
    total = _route_bytes(shape, tokens) + pairs * ROUTE_PAIR
    gate_up, down = setup.adapts("gate_up_proj"), setup.adapts("down_proj")
    if setup.quant == "none":
        total += pairs * (3 * i + h) * d
        for adapted, width, numel in ((gate_up, h, 2 * h * i), (down, i, h * i)):
            if adapted:  # ParamWrapper: the merged weights and the input are saved
                total += pairs * width * d + shape.experts * numel * d
        return total
    return total + pairs * _pair_bytes(shape, setup)


def _pair_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """What a 4-bit expert saves per routed pair (its routing indices' ``ROUTE_PAIR`` aside)."""
    h, i, d, a, r = shape.hidden, shape.intermediate, setup.d, setup.a, setup.lora_r
    total = (3 * i + 2 * h) * d
    if setup.adapts("gate_up_proj"):
        total += (h + r) * a
    if setup.adapts("down_proj"):
        total += (i + r) * a
    return total


def expert_recompute_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """A recomputed 4-bit MoE layer's peak beyond all it saved: the larger of
    :func:`expert_moments`."""
    return max(expert_moments(shape, setup))


def expert_moments(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(forward, backward)``: a recomputed 4-bit MoE layer's peak beyond all it saved (adapters in the compute dtype).

    Worst case, as everywhere here: every token at each of its k experts (T tokens each).
    Counted from the tracker's listing of the recomputed layer (Mixtral and Qwen3-MoE, fp32
    and bf16): the peak is the last expert's, either in the recomputed forward — the
    layer's residual, normed input and output accumulator alive (3·T·h·d; 2 in fp32), the expert's
    own saved tensors not all made yet, and inside one projection its gathered input, the
    base output, the adapter's output and its scaled copy (3·T·out·d; in 16-bit the
    previous expert's fp32 weighted output too) — or in its backward, once its own saved
    tensors are freed: the gradient slices peft's ``ParamWrapper`` layout gives each
    expert's adapters (full-size, E·r·(3I + 2h)·a), the gate/up output's gradient (2·T·I·d),
    the input gradients (2·T·h·d) and the expert's gate/up weight dequantized (2I·h·d).
    """
    if setup.mlp_tile is not None:
        return _tiled_moments(shape, setup)
    return _moments(shape, setup, setup.tokens)


def _moments(shape: ModelShape, setup: TrainSetup, t: int, *, live_tokens: int | None = None,
             minus_share: bool = True) -> tuple[int, int]:
    """:func:`expert_moments` for ``t`` tokens at the experts (``live_tokens``: the layer's
    own, default ``t``); ``minus_share``: the last expert's saved tensors are in the layer's saved
    bytes (untiled), so its moments count only what is beyond them."""
    h, i, d, a, r = shape.hidden, shape.intermediate, setup.d, setup.a, setup.lora_r
    n = t if live_tokens is None else live_tokens
    gu, dn = setup.adapts("gate_up_proj"), setup.adapts("down_proj")
    share = t * _pair_bytes(shape, setup) if minus_share else 0  # the last expert's saved tensors
    idx = 2 * t * 8  # its token and slot indices (int64)

    def project(width: int, adapted: bool) -> int:
        return t * r * a + 3 * t * width * d if adapted else t * width * d

    gate_up = (t * h * 4 if d != 4 else 0) + idx + t * h * d + project(2 * i, gu)
    down = (idx + t * h * d + (t * r * a if gu else 0) + 4 * t * i * d
            + project(h, dn))
    # the residual, the normed input and the output accumulator; in fp32 the residual is
    # the post-attention norm's saved input itself (no cast), already counted
    live = (3 if d != 4 else 2) * n * h * d
    forward = live - share + max(gate_up, down)
    slices = shape.experts * r * a * ((h + 2 * i if gu else 0) + (i + h if dn else 0))
    backward = (-share + slices + 2 * t * i * d + 2 * t * h * d
                + t * shape.experts_per_token * 4 + 2 * i * h * d)
    return forward, backward


def expert_lora_params(shape: ModelShape, setup: TrainSetup) -> int:
    """LoRA elements on one layer's experts (peft's parameter LoRA: rank r per expert)."""
    h, i, r, e = shape.hidden, shape.intermediate, setup.lora_r, shape.experts
    return e * r * ((h + 2 * i if setup.adapts("gate_up_proj") else 0)
                    + (i + h if setup.adapts("down_proj") else 0))


def _tiled_held(shape: ModelShape, setup: TrainSetup, *, tile_grads: bool = True) -> int:
    """What a tiled experts call holds in backward besides its tile, from the second tile
    on (:class:`~tightfit.checkpoint.tiled_function.TiledMLPFunction`): the gradients of
    all its inputs (the hidden states, T·h·d, and the routing weights, T·k·4) and the
    experts' adapter gradients, an fp32 sum over the tiles beside one tile's
    (``tile_grads=False``: the tile's are counted elsewhere)."""
    t, k = setup.tokens, shape.experts_per_token
    per = 4 + (DTYPE_BYTES[setup.lora_dtype] if tile_grads else 0)
    return t * shape.hidden * setup.d + t * k * 4 + expert_lora_params(shape, setup) * per


def _tile_pairs_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """What one recomputed tile of the experts saves (its routed pairs' tensors)."""
    pairs = setup.mlp_tile_tokens * shape.experts_per_token
    if setup.quant == "none":
        return pairs * ((3 * shape.intermediate + shape.hidden) * setup.d + ROUTE_PAIR)
    return pairs * (_pair_bytes(shape, setup) + ROUTE_PAIR)


def _tiled_moments(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """:func:`expert_moments` with the experts tiled: the recomputed forward runs each tile
    without grad (nothing saved, the tiles' output buffer of T·h·d beside it); the backward
    peaks at a tile's last expert, the tile's saved tensors and what the call holds
    (:func:`_tiled_held`) beside it."""
    u = setup.mlp_tile_tokens
    forward, backward = _moments(shape, setup, u, live_tokens=setup.tokens,
                                  minus_share=False)
    forward += setup.tokens * shape.hidden * setup.d
    backward += _tile_pairs_bytes(shape, setup) - u * _pair_bytes(shape, setup)
    # (the tile's adapter gradient slices are in _moments' backward)
    return forward, backward + _tiled_held(shape, setup, tile_grads=False)


def expert_backward_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """One expert's backward with all T tokens routed to it (the worst case).

    4-bit: its gate/up projection dequantized (2I·h·d) beside its intermediate's gradient
    (T·I·d) and, with LoRA on the experts, the adapters' input gradients in the adapter
    dtype (T·(h + I)·a). Unquantized with peft's parameter LoRA: the gradient of one merged
    expert weight stack (E·I·h·d) and two intermediate gradients. Measured with every token
    at the same experts (``tightfit plan --verify`` zeroes the routers); the attention's
    backward (:func:`tightfit.planner.activations.attention_backward_bytes`) is the other
    moment of a MoE layer.
    """
    if setup.mlp_tile is not None:  # one tile's experts, its saved tensors, what the call holds
        return (_expert_backward(shape, setup, setup.mlp_tile_tokens)
                + _tile_pairs_bytes(shape, setup) + _tiled_held(shape, setup))
    return _expert_backward(shape, setup, setup.tokens)


def _expert_backward(shape: ModelShape, setup: TrainSetup, t: int) -> int:
    """:func:`expert_backward_bytes` for ``t`` tokens at one expert."""
    h, i, d = shape.hidden, shape.intermediate, setup.d
    lora = setup.adapts("gate_up_proj") or setup.adapts("down_proj")
    if setup.quant == "none":
        return (shape.experts * i * h * d + 2 * t * i * d) if lora else t * i * d
    return 2 * i * h * d + t * i * d + (t * (h + i) * setup.a if lora else 0)
