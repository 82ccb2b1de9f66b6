"""Activation memory of a Llama-family decoder under a checkpoint plan.

The formulas count the tensors autograd saves for backward in a transformers Llama
decoder layer (RMSNorm → q/k/v → rotary → SDPA → o → residual → RMSNorm → SwiGLU MLP →
residual) with a frozen base and peft LoRA adapters, plus the transients of the backward
pass, and the LM head + cross-entropy. Symbols: T = batch × seq tokens, h hidden, i
intermediate, q = heads × head_dim, kv = kv_heads × head_dim, d bytes of the compute dtype,
a bytes of the adapter dtype, r LoRA rank, V vocabulary.

Saved per layer (frozen base: a frozen linear saves no input; only adapters do):

* each RMSNorm: its input in fp32 (T·h·4; a view when d = 4) and the rsqrt (T·4) — not
  for the first layer's input norm, whose input (the frozen embedding) needs no grad;
* the normed input of q/k/v and of gate/up, and the attention output and the SwiGLU
  product (inputs of o and down), once when the adapters share the compute dtype, else
  one cast copy (T·in·a) per adapter;
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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tightfit.checkpoint.plan import Segment, parse_policy, structural_segments, uniform_segments

if TYPE_CHECKING:
    from tightfit.planner.presets import ModelShape
    from tightfit.planner.setup import TrainSetup

# Calibrated on small Llama configs with the tracker (CPU, fp32 and bf16): see module doc.
BWD_I = 2.0
BWD_H16 = 2.5


# -- per-layer terms -----------------------------------------------------------------


def layer_saved_bytes(shape: ModelShape, setup: TrainSetup, *, first: bool = False) -> int:
    """Bytes one decoder layer saves for backward (see the module docstring)."""
    t, d, a, r = setup.tokens, setup.d, setup.a, setup.lora_r
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.q_size, shape.kv_size
    targets = set(setup.lora_targets)
    linears = shape.linear_shapes()
    total = 0
    norms = 1 if first else 2
    total += norms * (t * h * 4 + t * 4)
    # attention (SDPA flash / efficient): q, k, v, out, logsumexp
    total += t * (2 * q + 2 * kv) * d + setup.batch * shape.heads * setup.seq_len * 4
    # SwiGLU: gate, up, silu(gate)
    total += 3 * t * i * d
    # adapter inputs: shared when adapters compute in the compute dtype, else cast copies
    groups = (
        (("q_proj", "k_proj", "v_proj"), h, True),
        (("o_proj",), q, False),  # the SDPA output is already saved
        (("gate_proj", "up_proj"), h, True),
        (("down_proj",), i, True),
    )
    for names, width, needs_copy in groups:
        hit = [n for n in names if n in targets]
        if not hit:
            continue
        if setup.lora_dropout > 0:
            # per adapter: the dropped input in the adapter dtype, the 1-byte keep-mask and a
            # compute-dtype copy (a + 1 + d bytes per value; fitted on the CPU within ±4 %)
            total += len(hit) * t * width * (a + 1 + d)
        elif a != d:
            total += len(hit) * t * width * a
        elif needs_copy:
            total += t * width * d
    total += sum(t * r * a for n in targets if n in linears)
    return total


def layer_input_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The hidden state between layers: what a checkpointed segment keeps."""
    return setup.tokens * shape.hidden * setup.d


def backward_transient_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Gradients in flight while one layer runs backward (calibrated, see module doc).

    The largest moment is inside the SwiGLU backward: ``BWD_I`` · T·i·d of gradients, plus
    the adapters' r-wide gradients. A 16-bit compute dtype adds ``BWD_H16`` · T·h·4 of fp32
    gradients (RMSNorm and the fp32 adapters compute their gradients in fp32). A 4-bit or
    8-bit layer dequantizes its weight for the input gradient, beside that linear's input
    and output gradients; the larger of the two moments counts.
    """
    t, d = setup.tokens, setup.d
    mlp = BWD_I * t * shape.intermediate * d + 3 * t * setup.lora_r * setup.a
    if d != 4:
        mlp += BWD_H16 * t * shape.hidden * 4
    dequant = 0
    if setup.quant in ("nf4", "int8"):
        # a quantized linear's backward: its dequantized weight beside its input and output
        # gradients (and the fp32 gradients of 16-bit compute)
        dequant = max(fi * fo * d + t * (fi + fo) * d for fi, fo in shape.linear_shapes().values())
        if d != 4:
            dequant += BWD_H16 * t * shape.hidden * 4
    return int(max(mlp, dequant))


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
    if setup.loss_chunk_tokens is None:
        return 12 * t * v + (t * v * d if setup.keep_logits else 0)
    from tightfit.loss.sizing import predict_head_loss_bytes
    from tightfit.measure.dtypes import torch_dtype

    return predict_head_loss_bytes(
        v, setup.seq_len, setup.batch, torch_dtype(setup.compute_dtype), hidden_size=shape.hidden,
        chunk_tokens=setup.loss_chunk_tokens,
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


def final_norm_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The final RMSNorm's saved input (fp32) and rsqrt, plus the shared rotary cos/sin."""
    t = setup.tokens
    return t * shape.hidden * 4 + t * 4 + 2 * setup.seq_len * shape.head_dim * setup.d


# -- the peak under a plan -----------------------------------------------------------


def plan_peak(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...]) -> tuple[int, int]:
    """``(layers, head)``: bytes of the decoder and of the head + loss at the step's peak.

    The peak is the largest of (1) the start of backward — every stored segment's saved
    tensors, every checkpointed segment's input, and the head + loss at its peak —, (2) the
    final norm's backward right after, and (3) each segment's backward — the segments before
    it, its own input, its recomputed saved tensors and the backward transients.

    Args:
        shape: The architecture.
        setup: The pieces and the batch.
        segments: The plan's segments (:class:`~tightfit.checkpoint.plan.Segment`), in
            order over the layers, each ``"stored"`` or ``"checkpoint"``.

    Raises:
        ValueError: A ``"selective"`` segment (the planner does not model it).
    """
    if any(seg.kind == "selective" for seg in segments):
        raise ValueError("selective checkpoint segments are not modelled by the planner; pass "
                         "stored / checkpoint segments (policies none, every, sqrt, uniform:k, "
                         "budget).")
    a_first = layer_saved_bytes(shape, setup, first=True)
    a_rest = layer_saved_bytes(shape, setup)
    x = layer_input_bytes(shape, setup)
    dup = setup.tokens * shape.hidden * 4 if setup.d == 4 else 0  # fp32: norm saves the input

    def saved(start: int, stop: int) -> int:
        if stop <= start:
            return 0
        return (a_first if start == 0 else a_rest) + a_rest * (stop - start - 1)

    head = head_loss_bytes(shape, setup)
    trans = backward_transient_bytes(shape, setup)
    kept = [x if seg.kind == "checkpoint" else saved(seg.start, seg.stop) for seg in segments]
    start_of_backward = sum(kept) + final_norm_bytes(shape, setup)
    extra = quantized_backward_extra_bytes(shape, setup)
    best_layers, best_head = start_of_backward, head
    # the final RMSNorm's backward, once the head is done: the hidden-state gradient and
    # two fp32 gradients of the norm (visible when a chunked head keeps the head small)
    t, h = setup.tokens, shape.hidden
    norm_backward = start_of_backward + extra + t * h * setup.d + 2 * t * h * 4
    if norm_backward > best_layers + best_head:
        best_layers, best_head = norm_backward, 0
    for j, seg in enumerate(segments):
        s, e, ck = seg.start, seg.stop, seg.kind == "checkpoint"
        before = sum(kept[:j]) + extra
        own = saved(s, e) - (dup if ck and s > 0 else 0)
        if ck and setup.d != 4:
            own += (e - s - 1) * x  # 16-bit: recomputed inner layer outputs stay alive
        layers = before + (x if ck else 0) + own + trans + x
        if layers > best_layers + best_head:
            best_layers, best_head = layers, 0
    return best_layers, best_head


def recompute_fraction(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...]) -> float:
    """Recomputed forward time ÷ step time without checkpointing (frozen base, LoRA).

    With a frozen base, backward computes input gradients only, so it costs about one
    forward: a step is ≈ 2 forwards and recomputing every layer adds ≈ 50 %. Layer cost is
    taken as proportional to its weights' matmul work; the head's is ``V·h`` per token.
    """
    layer = sum(fi * fo for fi, fo in shape.linear_shapes().values())
    head = shape.vocab * shape.hidden
    recomputed = sum(len(seg) for seg in segments if seg.kind == "checkpoint") * layer
    if setup.loss_chunk_tokens is not None:
        recomputed += head
    return recomputed / (2 * (shape.layers * layer + head))


def budget_segments(shape: ModelShape, setup: TrainSetup, budget: int) -> tuple[Segment, ...] | None:
    """The least-recompute plan whose predicted activation peak fits ``budget``.

    Layers of one architecture are equal, so a plan is characterized by how many layers
    stay stored (kept first, no recompute) and how long the checkpointed segments are;
    enumerate both (O(L²)) and keep the fitting plan with the most stored layers, ties
    going to the lower peak. ``None`` when not even every-layer checkpointing fits.
    """
    n = shape.layers
    best: tuple[int, int, tuple[Segment, ...]] | None = None
    for k in range(1, n + 1):
        for stored in range(n, -1, -1):
            rest = n - stored
            segs = [Segment(0, stored, "stored")] if stored else []
            if rest:
                segs += [Segment(stored + c.start, stored + c.stop, "checkpoint")
                         for c in uniform_segments(rest, math.ceil(rest / k))]
            layers, head = plan_peak(shape, setup, tuple(segs))
            peak = layers + head
            if peak <= budget:
                key = (-stored, peak)
                if best is None or key < best[:2]:
                    best = (-stored, peak, tuple(segs))
                break  # fewer stored layers only adds recompute
    return None if best is None else best[2]


def activation_peak(
    shape: ModelShape, setup: TrainSetup
) -> tuple[int, int, tuple[Segment, ...], float]:
    """``(layers, head, segments, recompute_fraction)`` for ``setup.checkpoint``.

    A ``budget`` plan that cannot fit falls back to every-layer checkpointing (the
    smallest plan), whose peak then exceeds the budget: callers compare against it.
    """
    name, k = parse_policy(setup.checkpoint)
    if name == "budget":
        segments = budget_segments(shape, setup, int(setup.checkpoint_budget or 0))
        if segments is None:
            segments = structural_segments("every", None, shape.layers)
    else:
        segments = structural_segments(name, k, shape.layers)
    layers, head = plan_peak(shape, setup, segments)
    return layers, head, segments, recompute_fraction(shape, setup, segments)
