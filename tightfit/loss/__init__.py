"""tightfit.loss: the LM head and loss, computed in chunks.

``chunked_cross_entropy`` is the loss; ``enable_chunked_loss``/``disable_chunked_loss`` wire
it into an HF causal LM (applying the model's ``LogitTransform``: Gemma 2's soft-cap, ...);
``auto_chunk_tokens`` and ``predict_head_loss_bytes`` size it for
the planners (the head+loss is the last segment of the layer chain).
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
