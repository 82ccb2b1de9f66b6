"""tightfit.loss: the LM head and loss, computed in chunks.

Here:
    chunked: ``chunked_cross_entropy``, the head + cross-entropy a chunk of tokens at a time,
        gradients included.
    hf: ``enable_chunked_loss``/``disable_chunked_loss``, wiring it into an HF causal LM
        (peft-wrapped or not) without editing its code; ``predict_model_head_loss_bytes``.
    transform: ``LogitTransform``, what some families apply to the logits first (Gemma 2's
        soft-cap, Cohere's and Granite's scale).
    router: the load-balancing loss a MoE model adds, for the chunked forward.
    sizing: ``auto_chunk_tokens`` and ``predict_head_loss_bytes``, for the planners (the
        head + loss is the last segment of the layer chain).

May import measure, model, integrity and tiers; it needs none of them (torch and
transformers only).
Entry point: :func:`tightfit.enable_chunked_loss`; the names below are re-exported here.
"""

from tightfit.loss.chunked import chunked_cross_entropy
from tightfit.loss.hf import (
    disable_chunked_loss,
    enable_chunked_loss,
    is_chunked_loss_enabled,
    logit_transform_of,
    predict_model_head_loss_bytes,
)
from tightfit.loss.sizing import (
    auto_chunk_tokens,
    chunk_bytes_per_token,
    head_compute_dtype,
    head_kind_of,
    predict_head_loss_bytes,
)
from tightfit.loss.transform import LogitTransform

__all__ = [
    "LogitTransform",
    "auto_chunk_tokens",
    "chunk_bytes_per_token",
    "chunked_cross_entropy",
    "disable_chunked_loss",
    "enable_chunked_loss",
    "head_compute_dtype",
    "head_kind_of",
    "is_chunked_loss_enabled",
    "logit_transform_of",
    "predict_head_loss_bytes",
    "predict_model_head_loss_bytes",
]
