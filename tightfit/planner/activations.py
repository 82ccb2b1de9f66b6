"""Activation memory of a Llama-family decoder, term by term (plans: :mod:`.peak`).

The formulas count the tensors autograd saves for backward in a transformers Llama
decoder layer (RMSNorm → q/k/v → rotary → SDPA → o → residual → RMSNorm → SwiGLU MLP →
residual) with a frozen base and peft LoRA adapters, plus the transients of the backward
pass, and the LM head + cross-entropy. Symbols: T = batch × seq tokens, h hidden, i
intermediate, q = heads × head_dim, kv = kv_heads × head_dim, d bytes of the compute dtype,
a bytes of what the adapters compute in (:attr:`TrainSetup.a`: d with the default
``lora_compute="compute_dtype"``, the fp32 masters cast to it; the adapters' own dtype with
peft's ``"lora_dtype"``), r LoRA rank, V vocabulary.

Saved per layer (frozen base: a frozen linear saves no input; only adapters do):

* each RMSNorm: its input in fp32 (T·h·4; a view when d = 4) and the rsqrt (T·4) — not
  for the first layer's input norm, whose input (the frozen embedding) needs no grad;
* the normed input of q/k/v and of gate/up, and the attention output and the SwiGLU
  product (inputs of o and down), once when the adapters compute in the compute dtype
  (a = d), else one cast copy (T·in·a) per adapter (peft's fp32 adapters in 16-bit
  compute with ``lora_compute="lora_dtype"``);
* SDPA (flash / memory-efficient kernels): q, k, v, the output, and the log-sum-exp
  (batch·heads·seq·4);
* SwiGLU: gate, up and silu(gate) outputs (3·T·i·d);
* each adapter: its r-wide hidden (T·r·a); with dropout, per adapter the dropped input,
  its keep-mask and a compute-dtype copy (T·in·(a + 1 + d), fitted).

The backward transients (gradients of the layer's intermediates in flight) are
``BWD_I`` · T·i·d (+ ``BWD_H16`` · T·h·4 of fp32 gradients in 16-bit compute), or one
dequantized weight with its linear's gradients for 4-bit layers when that is larger;
``BWD_*`` were calibrated against :class:`~tightfit.measure.tracker.MemoryTracker` on small
configurations (see ``tests/planner/test_estimate.py`` and docs/plan.md).

Long context (``setup.mlp_tile``, ``setup.offload``): a tiled MLP
(:mod:`tightfit.checkpoint.tiling`) saves only its input (T·h·d) and holds one tile's
intermediates at a time in backward, so its terms use the tile's tokens instead of T; the
attention's stay O(T·h) (SDPA keeps nothing T×T). Offloaded segments keep their bytes on the
host; the device holds only the segments in flight (:func:`tightfit.planner.peak.plan_peak`). These terms are
counted from the mechanisms' code, not fitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit.planner.attention import attention_saved_bytes, eager_backward_bytes
from tightfit.planner.moe import (
    expert_backward_bytes,
    expert_recompute_bytes,
    expert_saved_bytes,
    tiled_expert_saved_bytes,
)
from tightfit.planner.shapes import MLP_WEIGHTS

if TYPE_CHECKING:
    from tightfit.planner.shapes import ModelShape
    from tightfit.planner.train_setup import TrainSetup

# Calibrated on small Llama configs with the tracker (CPU, fp32 and bf16): see module doc.
BWD_I = 2.0
BWD_H16 = 2.5
# The same fp32 gradients when the adapters compute in the 16-bit compute dtype (a = d: the
# default lora_compute="compute_dtype", or 16-bit adapters) without dropout: the adapters'
# own fp32 gradients are gone, the RMSNorms' remain. Measured with the tracker (bf16, CPU,
# tiled and untiled MLPs, NF4 and unquantized bases, T = 64-1024) within -1 % .. +9 %.
BWD_H16_A16 = 1.0


def fp32_grad_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> float:
    """The fp32 gradients in flight at a backward moment of 16-bit compute (0 in fp32):
    ``BWD_H16`` · tokens·h·4 with adapters computing in fp32 (or with dropout),
    ``BWD_H16_A16`` · tokens·h·4 when they compute in the compute dtype."""
    if setup.d == 4:
        return 0.0
    same = setup.a == setup.d and setup.lora_dropout == 0
    return (BWD_H16_A16 if same else BWD_H16) * tokens * shape.hidden * 4


# -- per-layer terms -----------------------------------------------------------------

# adapter groups of a decoder layer: (targets, input width, needs its own copy when the
# adapters share the compute dtype, part of the MLP)
def _groups(shape: ModelShape) -> tuple[tuple[tuple[str, ...], int, bool, bool], ...]:
    h, i, q = shape.hidden, shape.intermediate, shape.q_size
    if shape.traits.fused:  # Phi-3: one qkv_proj, one gate_up_proj
        attn: tuple[tuple[tuple[str, ...], int, bool, bool], ...] = (
            (("qkv_proj",), h, True, False), (("o_proj",), q, False, False))
        mlp = ((("gate_up_proj",), h, True, True), (("down_proj",), i, True, True))
    else:
        attn = ((("q_proj", "k_proj", "v_proj"), h, True, False),
                (("o_proj",), q, False, False))  # the SDPA output is already saved
        mlp = ((("gate_proj", "up_proj"), h, True, True), (("down_proj",), i, True, True))
    return attn if shape.is_moe else attn + mlp


def _adapter_input_bytes(setup: TrainSetup, names: tuple[str, ...], width: int,
                         needs_copy: bool, tokens: int) -> int:
    """What the adapters of one group save of their input, for ``tokens`` tokens."""
    hit = [n for n in names if setup.adapts(n)]
    if not hit:
        return 0
    d, a = setup.d, setup.a
    if setup.lora_dropout > 0:
        # per adapter: the dropped input in the adapter dtype, the 1-byte keep-mask and a
        # compute-dtype copy (a + 1 + d bytes per value; fitted on the CPU within ±4 %)
        return len(hit) * tokens * width * (a + 1 + d)
    if a != d:
        return len(hit) * tokens * width * a
    return tokens * width * d if needs_copy else 0


def mlp_saved_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """What an (untiled) MLP with its adapters saves for ``tokens`` tokens: a gated MLP's
    gate, up and act(gate) (3·T·i·d; Phi-3's fused gate_up the same), or a MoE layer's
    experts and router (:mod:`tightfit.planner.moe`)."""
    if shape.is_moe:
        return expert_saved_bytes(shape, setup, tokens)
    total = 3 * tokens * shape.intermediate * setup.d  # gate, up, act(gate)
    for names, width, needs_copy, mlp in _groups(shape):
        if mlp:
            total += _adapter_input_bytes(setup, names, width, needs_copy, tokens)
            total += sum(tokens * setup.lora_r * setup.a for n in names if setup.adapts(n))
    return total


def norm_bytes(shape: ModelShape, setup: TrainSetup, norms: int) -> int:
    """``norms`` RMSNorms' saved fp32 input and rsqrt (Gemma's also its fp32 1 + weight)."""
    t, h = setup.tokens, shape.hidden
    plus_one = h * 4 if shape.family.startswith("gemma") else 0
    return norms * (t * h * 4 + t * 4 + plus_one)


def layer_saved_bytes(shape: ModelShape, setup: TrainSetup, *, first: bool = False,
                      layer: int | None = None) -> int:
    """Bytes one decoder layer saves for backward (see the module docstring).

    ``layer`` picks the layer (its attention type; default: the first layer when ``first``,
    else the second); the first layer's input norm saves nothing (the embedding needs no
    grad). With a tiled MLP the MLP keeps only its input (T·h·d); its intermediates live
    one tile at a time in backward (:func:`backward_transient_bytes`).
    """
    layer = (0 if first else min(1, shape.layers - 1)) if layer is None else layer
    t, a, r = setup.tokens, setup.a, setup.lora_r
    norms = shape.traits.norms - (1 if layer == 0 else 0)
    total = norm_bytes(shape, setup, norms) + attention_saved_bytes(shape, setup, layer)
    for names, width, needs_copy, mlp in _groups(shape):
        if not mlp:
            total += _adapter_input_bytes(setup, names, width, needs_copy, t)
            total += sum(t * r * a for n in names if setup.adapts(n))
    if setup.mlp_tile is None:
        total += mlp_saved_bytes(shape, setup, t)
    elif shape.is_moe:  # the router runs untiled; the tiled experts keep their inputs
        total += tiled_expert_saved_bytes(shape, setup, t)
    else:
        total += t * shape.hidden * setup.d
    return total


def layer_input_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The hidden state between layers: what a checkpointed segment keeps."""
    return setup.tokens * shape.hidden * setup.d


def _dequant_moment(shape: ModelShape, setup: TrainSetup) -> int:
    """A quantized linear's backward: its dequantized weight beside its input and output
    gradients (the MLP's see one tile's tokens when it is tiled). A tiled MLP's weight is
    dequantized as :func:`_base_input_grad` counts it (an NF4 weight in fp32 and its cast,
    what a tile's backward holds at Phi-3's H × 2I gate_up), beside the MLP input's
    gradient of all T tokens that the tiled function keeps (T·h·d)."""
    if setup.quant not in ("nf4", "int8"):
        return 0
    d, tile = setup.d, setup.mlp_tile_tokens
    moments = []
    for name, (fi, fo) in shape.linear_shapes().items():
        tokens = tile if name in MLP_WEIGHTS else setup.tokens
        moment = fi * fo * d + tokens * (fi + fo) * d
        if setup.mlp_tile is not None and name in MLP_WEIGHTS:
            moment = (max(moment, _base_input_grad(setup, fi, fo, tokens))
                      + setup.tokens * shape.hidden * d)
        moments.append(moment)
    return max(moments)


def tiled_mlp_backward_bytes(shape: ModelShape, setup: TrainSetup, tile: int) -> int:
    """A tiled MLP's backward moment (:mod:`tightfit.checkpoint.tiling`, counted, not fitted).

    One tile recomputed with grad: its saved tensors, ``BWD_I`` · tile·i·d of gradients, the
    adapters' r-wide ones and, in 16-bit compute, ``BWD_H16`` · tile·h·4 of fp32 gradients
    — all per tile, since each tile runs its backward alone; beside them the MLP input's
    full gradient (T·h·d) and the adapters' parameter gradients, summed over the tiles in
    fp32 (an accumulator and one tile's, 2 × 4 bytes per MLP adapter parameter).
    """
    t, d, h = setup.tokens, setup.d, shape.hidden
    one = (mlp_saved_bytes(shape, setup, tile) + BWD_I * tile * shape.intermediate * d
           + 3 * tile * setup.lora_r * setup.a)
    one += fp32_grad_bytes(shape, setup, tile)
    linears = shape.linear_shapes()
    params = sum(setup.lora_r * sum(linears[n]) for n in MLP_WEIGHTS
                 if n in linears and setup.adapts(n))
    return int(one + t * h * d + 2 * 4 * params)


def attention_backward_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """SDPA's backward moment: the gradients of q, k, v and the output and the kernels' fp32
    query-gradient accumulator (T·(2q + 2kv)·d + T·q·4), plus the fp32 gradients of 16-bit
    compute. Nothing T×T: the flash / memory-efficient kernels recompute the scores."""
    t, d, q, kv = setup.tokens, setup.d, shape.q_size, shape.kv_size
    return int(t * (2 * q + 2 * kv) * d + t * q * 4 + fp32_grad_bytes(shape, setup, t))


def backward_transient_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Gradients in flight while one layer runs backward (calibrated, see module doc).

    The largest moment is inside the SwiGLU backward: ``BWD_I`` · T·i·d of gradients, plus
    the adapters' r-wide gradients. A 16-bit compute dtype adds ``BWD_H16`` · T·h·4 of fp32
    gradients (RMSNorm, and adapters computing in fp32, make their gradients in fp32). A 4-bit or
    8-bit layer dequantizes its weight for the input gradient, beside that linear's input
    and output gradients; the larger of the moments counts.

    With a tiled MLP the SwiGLU moment is one tile's (:func:`tiled_mlp_backward_bytes`) and
    the attention's backward (:func:`attention_backward_bytes`) becomes a moment of its own.
    Both are counted from the code (:mod:`tightfit.checkpoint.tiling`, SDPA), not fitted.
    """
    t, d = setup.tokens, setup.d
    h16 = fp32_grad_bytes(shape, setup, t)
    if shape.is_moe:
        moments = [expert_backward_bytes(shape, setup) + h16,
                   attention_backward_bytes(shape, setup)]
    elif setup.mlp_tile is None:
        moments = [BWD_I * t * shape.intermediate * d + 3 * t * setup.lora_r * setup.a + h16]
    else:
        moments = [tiled_mlp_backward_bytes(shape, setup, setup.mlp_tile_tokens),
                   attention_backward_bytes(shape, setup)]
    if shape.eager_attention:
        moments.append(eager_backward_bytes(shape, setup) + h16)
    dequant = _dequant_moment(shape, setup)
    if dequant:
        moments.append(dequant + h16)
    return int(max(moments))


# Live fp32 [T, h] tensors at the peak of a Gemma RMSNorm's backward: its output gradient
# in fp32, that times (1 + w), and the rsqrt's gradient chain (pow, div, mul) — listed on a
# CPU step (gemma2, bf16), not fitted: the post-MLP norm runs backward first, with all the
# layer saved still alive.
GEMMA_NORM_BWD = 5


def _base_input_grad(setup: TrainSetup, fan_in: int, fan_out: int, tokens: int) -> int:
    """A frozen linear's input-gradient moment: a 4-bit weight dequantized to fp32 and, in
    16-bit compute, cast (in·out·(4 + d)), or the cast weight beside the input gradient
    (in·out·d + tokens·in·d), whichever is larger; an int8 weight dequantized straight to
    the input's dtype beside the gradient (bitsandbytes' ``MatMul8bitLt.backward``:
    in·out·d + tokens·in·d); unquantized, the gradient alone."""
    d, w = setup.d, fan_in * fan_out
    if setup.quant == "none":
        return tokens * fan_in * d
    if setup.quant == "int8":
        return w * d + tokens * fan_in * d
    deq = w * 4 + (w * d if d != 4 else 0)
    return max(deq, w * d + tokens * fan_in * d)


def layer_backward_bytes(shape: ModelShape, setup: TrainSetup, layer: int) -> int:
    """One layer's bytes at the peak of its backward: what it saved and still holds, and
    the gradients in flight (the layer's gradient input, T·h·d, not included).

    Counted from the order backward runs a layer in (listed with the tracker, per family):

    * the down projection first: its adapter's backward has freed the input it kept (the
      gated product) and its r-wide hidden by the time the base weight is dequantized,
      beside the adapter branch's input gradient (T·i·d);
    * then gate/up: the MLP's saved tensors are gone, the gradients of the gate and up
      outputs (2·T·i·d) and the adapters' input gradient (T·h·d) are in flight beside one
      dequantized weight — Phi-3's fused gate_up is twice as large, and peaks here;
    * with four norms (Gemma 2/3), the post-MLP norm's backward before both, with all of
      the layer saved still alive (:data:`GEMMA_NORM_BWD` fp32 tensors of T·h);
    * eager attention: its scores' moment beside all of the layer saved;
    * the recompute's last op before all these: the down projection's output and its
      adapter's two outputs and the residual (T·h·(2d + 2a)) beside all of the layer saved.

    With adapters in another dtype than the compute one (peft's fp32 adapters in bf16, NF4)
    the recompute's last op peaks: the adapters saved cast copies, so the MLP's input and
    the gated product are alive besides as the forward's arguments, and the recompute runs
    inside the down adapter's backward, its output gradient cast and scaled in flight.

    Listed and checked on NF4 and int8 bases (int8: the weight dequantized straight to the
    compute dtype; what its matmul holds outside the hooks is :func:`int8_held_bytes`) with
    adapters in the compute dtype (the QLoRA recipe's bf16, or fp32 throughout), and NF4
    with fp32 adapters in bf16 without dropout; a 4-bit MoE layer there peaks at its last
    expert (:func:`~tightfit.planner.moe.expert_moments`). Other MoE layers, unquantized
    bases, tiled MLPs, int8 or dropout with adapters in another dtype keep the calibrated
    transients of :func:`backward_transient_bytes` and (dense layers) the quantized base's
    extra beside all of the layer saved.
    """
    saved = layer_saved_bytes(shape, setup, layer=layer)
    if (shape.is_moe and setup.quant == "nf4" and setup.a == setup.d
            and setup.lora_dropout == 0):
        return saved + expert_recompute_bytes(shape, setup)
    if (shape.is_moe or setup.quant not in ("nf4", "int8") or setup.mlp_tile is not None
            or (setup.a != setup.d and (setup.quant != "nf4" or setup.lora_dropout > 0))):
        # the quantized extra was calibrated on dense layers; a recomputed MoE layer peaks
        # inside its experts' recomputed forward, where the listing shows no such tensor
        extra = 0 if shape.is_moe else quantized_backward_extra_bytes(shape, setup)
        return saved + backward_transient_bytes(shape, setup) + extra
    t, h, i, d = setup.tokens, shape.hidden, shape.intermediate, setup.d
    g = max(setup.a, d)  # an adapter branch's input gradient, in the wider of the two
    down_kept, down = 0, _base_input_grad(setup, i, h, t)
    if setup.adapts("down_proj"):
        down_kept = _adapter_input_bytes(setup, ("down_proj",), i, True, t) + t * setup.lora_r * setup.a
        down += t * i * g
        if setup.a == d:
            # then the base's and the adapter branch's input gradients are summed into a
            # third tensor (autograd's out-of-place accumulation): 3·T·i·d, which outgrows
            # the dequantized weight's moment at long T (listed, bf16 NF4, T = 512)
            down = max(down, 3 * t * i * d)
    gate_up = 2 * t * i * d + _base_input_grad(setup, h, (2 if shape.traits.fused else 1) * i, t)
    if any(setup.adapts(n) for n in ("gate_proj", "up_proj", "gate_up_proj")):
        gate_up += t * h * g
    # the recompute's last op: the down projection's output beside all the layer saved (its
    # adapter's output and the scaled copy in the adapter dtype) and the residual the
    # layer's forward still holds
    last = t * h * (2 * d + (2 * setup.a if setup.adapts("down_proj") else 0))
    if setup.a != d and setup.adapts("down_proj"):
        # adapters in another dtype save cast copies: the MLP's input and the down
        # projection's (the gated product) are still alive as the forward's arguments; the
        # recompute starts inside the down adapter's backward, its output gradient cast and
        # scaled (T·h·(d + a)) in flight
        last += t * h * d + t * i * d + t * h * (d + setup.a)
    moments = [saved - down_kept + down, saved - mlp_saved_bytes(shape, setup, t) + gate_up,
               saved + last]
    if shape.traits.norms == 4:
        moments.append(saved + GEMMA_NORM_BWD * t * h * 4)
    if shape.eager_attention:
        moments.append(saved + eager_backward_bytes(shape, setup)
                       + fp32_grad_bytes(shape, setup, t))
    return int(max(moments))


def int8_held_bytes(shape: ModelShape, setup: TrainSetup, layer: int, *,
                    recomputed: bool) -> int:
    """Inputs an int8 base's linears of one layer hold from their forward to their backward.

    bitsandbytes' ``MatMul8bitLt`` keeps its input as a plain attribute of its autograd
    context (``ctx.tensors``), not through ``save_for_backward``, whenever the input requires
    grad: the checkpoint's saved-tensor hooks never see it, so a recomputed layer keeps it
    from the first forward until that linear's backward — on the device, offloaded or not
    (listed with the tracker: every checkpointed layer's normed inputs, attention output and
    gated product stay alive). One per distinct input (q/k/v share one, gate/up one); none
    until some adapter makes the stream require grad (layer 0's input is the frozen
    embedding's output). In a stored layer only what no adapter already saves as the very
    same tensor counts (an adapter saves its input itself in the compute dtype, no dropout).
    MoE layers: the attention's linears only (the experts are not int8 linears).
    """
    if setup.quant != "int8":
        return 0
    total, needs_grad = 0, layer > 0
    same = setup.a == setup.d and setup.lora_dropout == 0
    for names, width, _, _ in _groups(shape):
        adapted = any(setup.adapts(n) for n in names)
        if needs_grad and (recomputed or not (same and adapted)):
            total += setup.tokens * width * setup.d
        needs_grad = needs_grad or adapted
    return total


def rotary_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The shared rotary cos/sin: one pair per attention type where they differ (Gemma 3's
    local and global layers)."""
    return shape.rotary_kinds * 2 * setup.seq_len * shape.head_dim * setup.d


def recompute_inputs_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """What a recomputed layer's other inputs hold through backward (the checkpoint keeps
    them for the recompute): the rotary cos/sin and the masks the model built — eager
    attention's B·S² mask in the compute dtype per attention type, else a boolean S² one
    when some layer is masked (SDPA skips the mask in the others)."""
    s = setup.seq_len
    if shape.eager_attention:
        masks = shape.attention_kinds * setup.batch_size * s * s * setup.d
    else:
        masks = s * s if any(shape.masked(i, s) for i in range(shape.layers)) else 0
    return rotary_bytes(shape, setup) + masks


def head_loss_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Peak bytes of the LM head + cross-entropy during forward + backward.

    Unchunked (transformers' ``ForCausalLMLoss``, frozen head): the fp32 log-softmax output
    is saved; in backward its gradient, the logits' fp32 gradient and the log-softmax output
    are live together (12·T·V bytes), plus the logits themselves (T·V·d) when the caller
    keeps the model output alive through backward. Chunked: the prediction of
    :func:`tightfit.loss.sizing.predict_head_loss_bytes` (one chunk's logits and copies,
    plus the hidden-state gradient), checked against the tracker in
    ``tests/loss/test_sizing.py``.
    """
    t, v, d = setup.tokens, shape.vocab, setup.d
    softcap = shape.final_softcap is not None
    if setup.loss_chunk_tokens is None:
        # a soft-cap (Gemma 2) saves its tanh output too: one more logits copy
        return (12 * t * v + (t * v * d if setup.keep_logits else 0)
                + (t * v * d if softcap else 0))
    from tightfit.loss.sizing import predict_head_loss_bytes
    from tightfit.measure.dtypes import torch_dtype

    return predict_head_loss_bytes(
        v, setup.seq_len, setup.batch_size, torch_dtype(setup.compute_dtype),
        hidden_size=shape.hidden, chunk_tokens=setup.loss_chunk_tokens, softcap=softcap,
    )


def quantized_backward_extra_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Bytes a 4-bit / 8-bit base holds on top through the layers' backward.

    T·h·4 in fp32 compute, T·h·8 in 16-bit: calibrated against whole-model steps with the
    tracker (it appears with a quantized base, with or without the chunked loss, and not
    at the start of backward).
    """
    if setup.quant == "none":
        return 0
    return setup.tokens * shape.hidden * (4 if setup.d == 4 else 8)


def final_norm_backward_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The final RMSNorm's backward, beside everything saved: its input gradient (T·h·d)
    and two fp32 T·h temporaries, or in 16-bit compute the five fp32 T·h tensors listed at
    its peak (the upcast gradient, pow, div and two products: bf16, unquantized base,
    T = 64; with the adapters' fp32 gradients the layers' moments hid it)."""
    t, h = setup.tokens, shape.hidden
    grads = t * h * setup.d + 2 * t * h * 4
    return grads if setup.d == 4 else max(grads, 5 * t * h * 4)


def final_norm_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The final RMSNorm's saved input (fp32) and rsqrt, plus the shared rotary cos/sin."""
    return norm_bytes(shape, setup, 1) + rotary_bytes(shape, setup)
