"""What a decoder layer's attention saves for backward, per family and per layer type.

Counted from transformers' attention code with the tensors autograd saves (listed layer by
layer with ``saved_tensors_hooks`` on small configs, then checked on whole steps in
``tests/planner/test_families.py``). Symbols as in :mod:`tightfit.planner.activations`; B the
batch, S the sequence (T = B·S tokens), H heads, KV kv heads.

* SDPA without a mask (every causal layer, and a sliding-window layer while S ≤ window:
  transformers then skips the mask): q and k after the rotary embedding, v, the output and the
  log-sum-exp — T·(2q + 2kv)·d + B·H·S·4.
* SDPA with a mask (a sliding-window layer once S > window): transformers builds a boolean
  [B, 1, S, S] mask, SDPA converts it to an additive one in the compute dtype and keeps it
  for backward (B·S²·d, in every such layer), and under GQA it repeats k and v to the query
  heads first (it passes ``enable_gqa`` only without a mask): + 2·T·(q − kv)·d (nothing with
  one kv head, where the repeat is a view).
* eager attention (Gemma 2: SDPA has no attention soft-cap): the scores after the soft-cap's
  tanh (d), their fp32 softmax (4) and, below fp32, the softmax cast back (d) — B·H·S² each —
  with q and k, v repeated to the query heads; the output is not saved (the o_proj input is
  a contiguous copy, which an o_proj adapter of the compute dtype saves in its place).
* q/k norms (Qwen3, Gemma 3): each head's RMSNorm saves its fp32 input and rsqrt, T·(q +
  kv)·4 + T·(H + KV)·4, whatever the compute dtype.
* fused qkv (Phi-3): v is a view of the qkv output, which it keeps whole, and the rotary's
  concatenated query is one more copy: + T·(2q + kv)·d.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tightfit.planner.shapes import ModelShape
    from tightfit.planner.train_setup import TrainSetup


def sdpa_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """SDPA's saved tensors without a mask: q, k, v, the output, the log-sum-exp."""
    t, d = setup.tokens, setup.d
    return t * (2 * shape.q_size + 2 * shape.kv_size) * d + _lse(shape, setup)


def _lse(shape: ModelShape, setup: TrainSetup) -> int:
    return setup.batch_size * shape.heads * setup.seq_len * 4


def scores_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Eager attention's saved score matrices: B·H·S² × (d + 4 + d below fp32)."""
    d = setup.d
    per = d + 4 + (d if d != 4 else 0)
    return setup.batch_size * shape.heads * setup.seq_len**2 * per


def mask_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The additive mask SDPA converts and keeps in a masked layer (B·S²·d)."""
    return setup.batch_size * setup.seq_len**2 * setup.d


def _repeat_kv_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    # with one kv head the repeat is a view (the expanded size-1 head dimension merges
    # without a copy), so nothing more is saved
    if shape.kv_heads == 1:
        return 0
    return 2 * setup.tokens * (shape.q_size - shape.kv_size) * setup.d


def o_input_shared(shape: ModelShape, setup: TrainSetup) -> bool:
    """An o_proj adapter saves the attention output itself (same dtype, no dropout)."""
    return setup.adapts("o_proj") and setup.a == setup.d and setup.lora_dropout == 0


def attention_saved_bytes(shape: ModelShape, setup: TrainSetup, layer: int) -> int:
    """Bytes the attention of ``layer`` saves (adapters not included)."""
    t, d = setup.tokens, setup.d
    total = sdpa_bytes(shape, setup)
    if shape.eager_attention:
        total += scores_bytes(shape, setup) + _repeat_kv_bytes(shape, setup) - _lse(shape, setup)
        if not o_input_shared(shape, setup):
            total -= t * shape.q_size * d  # no SDPA output: the o_proj input is a copy
    elif shape.masked(layer, setup.seq_len):
        total += mask_bytes(shape, setup) + _repeat_kv_bytes(shape, setup)
    if shape.traits.qk_norm:
        total += t * (shape.q_size + shape.kv_size) * 4 + t * (shape.heads + shape.kv_heads) * 4
    if shape.traits.fused:
        total += t * (2 * shape.q_size + shape.kv_size) * d
    return total


def eager_backward_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Eager attention's backward moment: the scores' gradients in flight (fp32 softmax
    gradient and its input's, the tanh's) beside the saved scores — fitted, see
    :data:`BWD_SCORES` (0 for SDPA, whose kernels recompute the scores)."""
    if not shape.eager_attention:
        return 0
    return int(BWD_SCORES * setup.batch_size * shape.heads * setup.seq_len**2 * 4)


# Fitted on Gemma 2 configs (tests/planner/test_families.py: FITTED), checked held out.
BWD_SCORES = 2.0
