"""How many bytes the LM head and its loss need, and how many tokens a chunk should hold.

The head+loss is the last segment of the layer chain (see ``tightfit/checkpoint``); these
predictions let the checkpoint planner and the fit planner count it like any other segment.
All figures are bytes allocated *by* the head and loss during one forward+backward, above
the hidden states and the head's weights that exist anyway, measured per
``tightfit.measure.tracker.MemoryTracker`` (tests compare prediction and measurement).

Where the bytes are, per token and per vocabulary entry (``d`` = bytes of the logits dtype):

* unchunked, HF ``ForCausalLMLoss``: the logits (``d``; HF returns them, so they stay alive
  through backward), the fp32 log-softmax that cross-entropy saves (4), and in backward the
  NLL gradient (4) and the log-softmax gradient (4): ``d + 12``.
* chunked, ``"precompute"``, plain ``nn.Linear`` head: one fp32 buffer that becomes the loss
  gradient in place (4), plus below fp32 the logits before upcasting or the gradient cast
  back (``d``): 4 for fp32, 6 for bf16.
* chunked, another head module (peft LoRA, 4-bit): the module's own logits-sized
  temporaries come on top; fitted to peft's LoRA Linear, measured 12 for fp32 and 14 for
  bf16 (``3d`` and ``4 + 5d``). A 4-bit base adds its dequantized weight.
* chunked, ``"recompute"``: autograd's cross-entropy per chunk (log-softmax, NLL gradient,
  log-softmax gradient): 12, plus ``2d`` for a module head.
* a logit soft-cap (Gemma 2, ``softcap=True``): unchunked, HF's tanh output is one more
  logits copy (``d``); ``"precompute"`` keeps its derivative in a second fp32 buffer (at
  least 8 in all, measured: +4 fp32 and +2 bf16 for a linear head, nothing for a LoRA head
  whose temporaries are larger); ``"recompute"``: autograd saves the tanh (+4). A plain
  scale (Cohere, Granite) is done in place and costs nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

HeadKind = Literal["linear", "module", "4bit"]
ChunkStrategy = Literal["precompute", "recompute"]

#: With no budget, a chunk gets at most this fraction of the unchunked head+loss bytes ...
DEFAULT_FRACTION = 10
#: ... and at most this many bytes (keeps huge batches from making huge chunks) ...
DEFAULT_MAX_CHUNK_BYTES = 256 * 2**20
#: ... but at least this many tokens and this many bytes: smaller chunks save little in
#: absolute terms and their matmuls waste the hardware (each re-reads the whole head weight).
MIN_AUTO_CHUNK_TOKENS = 64
MIN_AUTO_CHUNK_BYTES = 32 * 2**20

#: Under an activation budget (``auto_chunk_tokens(activation_budget=...)``) one chunk's
#: working set takes at most this share of it: once a long step's layers are tiled and
#: offloaded, the default 32-256 MiB chunk would otherwise be the step's peak.
BUDGET_SHARE = 8

_LOSS_FP32 = 4  # the loss is always computed on fp32 logits
_ROW_VECTORS = 64  # bytes per chunk row of per-row vectors (max, sum, lse, target, masks)


def _dtype_bytes(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}."
        )
    return dtype.itemsize


def chunk_bytes_per_token(
    vocab_size: int,
    dtype: torch.dtype,
    *,
    head_kind: HeadKind = "linear",
    strategy: ChunkStrategy = "precompute",
    softcap: bool = False,
) -> int:
    """Bytes one token of a chunk holds at the chunk's peak (logits and their copies);
    ``softcap``: the logits are soft-capped first (see the module notes)."""
    d = _dtype_bytes(dtype)
    if strategy == "recompute":
        # autograd's cross-entropy on the recomputed chunk: the saved fp32 log-softmax, the
        # NLL gradient and the log-softmax gradient (the logits themselves are not saved)
        per_vocab = 3 * _LOSS_FP32
        if head_kind != "linear":
            per_vocab += 2 * d
    elif head_kind == "linear":
        # one fp32 buffer; below fp32 also the logits (freed once upcast), then the gradient
        # cast back (after the fp32 buffer is freed): 4 for fp32, 6 for bf16
        per_vocab = _LOSS_FP32 if d == _LOSS_FP32 else _LOSS_FP32 + d
    elif d == _LOSS_FP32:
        # a module head keeps its own temporaries: peft's LoRA forward adds its low-rank
        # output to the base output (two more logits-sized tensors); measured 12
        per_vocab = 3 * d
    else:
        per_vocab = _LOSS_FP32 + 5 * d  # same for bf16/fp16, measured 14
    if softcap:
        per_vocab = (per_vocab + _LOSS_FP32 if strategy == "recompute"
                     else max(per_vocab, 2 * _LOSS_FP32))
    return vocab_size * per_vocab


def predict_head_loss_bytes(
    vocab_size: int,
    seq_len: int,
    batch: int,
    dtype: torch.dtype,
    *,
    hidden_size: int,
    chunk_tokens: int | None = None,
    trainable_head_numel: int = 0,
    head_kind: HeadKind = "linear",
    strategy: ChunkStrategy = "precompute",
    softcap: bool = False,
) -> int:
    """Predicted peak bytes of the head and loss over one forward+backward.

    Args:
        vocab_size: Output vocabulary (columns of the logits).
        seq_len: Tokens per sequence.
        batch: Sequences per step.
        dtype: Dtype of the hidden states and logits (the head's compute dtype).
        hidden_size: Width of the hidden states (rows of their gradient).
        chunk_tokens: Tokens per chunk; ``None`` predicts HF's unchunked loss.
        trainable_head_numel: Elements of the head's trainable parameters (``vocab *
            hidden`` for a trained head, the LoRA factors for a LoRA head, 0 if frozen).
        head_kind: ``"linear"`` (plain or tied ``nn.Linear``), ``"module"`` (e.g. a
            LoRA-wrapped Linear) or ``"4bit"`` (a bitsandbytes ``Linear4bit`` base, which
            dequantizes its weight on every call).
        strategy: Chunked strategy (see :func:`tightfit.loss.chunked_cross_entropy`).
        softcap: The logits are soft-capped before the loss (Gemma 2).

    Returns:
        Peak bytes above the hidden states and weights present before the head runs.
    """
    _check_positive(vocab_size=vocab_size, seq_len=seq_len, batch=batch, hidden_size=hidden_size)
    d = _dtype_bytes(dtype)
    n = seq_len * batch
    grad_hidden = n * hidden_size * d
    labels = 3 * n * 8  # the padded, shifted and flattened int64 labels (HF copies them)
    dequant = vocab_size * hidden_size * d if head_kind == "4bit" else 0
    # a module head (LoRA) also saves its low-rank activations and sums two input gradients
    module_extra = 3 * grad_hidden if head_kind != "linear" else 0
    if chunk_tokens is None:
        # a soft-cap's tanh output stays alive too (autograd saves it), one more logits copy
        ce_stage = n * vocab_size * ((2 if softcap else 1) * d + 3 * _LOSS_FP32)
        # the head's own backward: logits still alive, their gradient, and the param grads
        matmul_stage = 2 * n * vocab_size * d + grad_hidden + trainable_head_numel * d
        return labels + dequant + module_extra + max(ce_stage, matmul_stage)
    _check_positive(chunk_tokens=chunk_tokens)
    c = min(chunk_tokens, n)
    labels += c * _ROW_VECTORS
    per_token = chunk_bytes_per_token(vocab_size, dtype, head_kind=head_kind, strategy=strategy,
                                      softcap=softcap)
    if strategy == "recompute":
        # AccumulateGrad adds each chunk's parameter gradient into .grad (param dtype)
        grads = trainable_head_numel * d
        chunk_stage = max(c * per_token, c * vocab_size * d + trainable_head_numel * d)
        return labels + dequant + module_extra + grad_hidden + grads + chunk_stage
    acc = trainable_head_numel * _LOSS_FP32  # fp32 gradient accumulators
    # below fp32 the weight-gradient matmul of a chunk lands in a temporary of the param dtype
    transient = trainable_head_numel * d if (d < _LOSS_FP32 or head_kind != "linear") else 0
    chunk_stage = max(c * per_token, c * vocab_size * d + transient)
    return labels + dequant + module_extra + grad_hidden + acc + chunk_stage


def auto_chunk_tokens(
    vocab_size: int,
    seq_len: int,
    batch: int,
    dtype: torch.dtype,
    budget: int | None = None,
    *,
    head_kind: HeadKind = "linear",
    softcap: bool = False,
    activation_budget: int | None = None,
) -> int:
    """Tokens per chunk for a vocabulary, batch shape and dtype.

    Args:
        vocab_size: Output vocabulary.
        seq_len: Tokens per sequence.
        batch: Sequences per step.
        dtype: Dtype of the logits.
        budget: Bytes allowed for one chunk's logits and their copies (the part of
            :func:`predict_head_loss_bytes` that grows with the chunk). ``None``: a
            tenth of the unchunked head+loss bytes, at most 256 MiB, at least 32 MiB and
            64 tokens;
            then evened out over the chunks (and rounded up to a multiple of 8 if that fits).
        head_kind: See :func:`predict_head_loss_bytes`.
        softcap: See :func:`predict_head_loss_bytes`.
        activation_budget: Bytes the whole step's activations may take (a checkpoint
            budget). With ``budget=None`` the default rule's chunk is shrunk, where needed,
            until one chunk's working set is at most ``1 / BUDGET_SHARE`` of it (evened out
            over the chunks, at least one token); the default is kept when it is smaller.

    Returns:
        Tokens per chunk, between 1 and ``seq_len * batch``.

    Raises:
        ValueError: A size is not positive, ``budget`` is below one token's bytes, or both
            ``budget`` and ``activation_budget`` are given.
    """
    _check_positive(vocab_size=vocab_size, seq_len=seq_len, batch=batch)
    n = seq_len * batch
    per_token = chunk_bytes_per_token(vocab_size, dtype, head_kind=head_kind, softcap=softcap)
    if activation_budget is not None:
        if budget is not None:
            raise ValueError("pass budget (one chunk's bytes) or activation_budget (the step's), "
                             "not both.")
        _check_positive(activation_budget=activation_budget)
        default = auto_chunk_tokens(vocab_size, seq_len, batch, dtype, head_kind=head_kind,
                                    softcap=softcap)
        largest = max(1, activation_budget // BUDGET_SHARE // per_token)
        return default if default <= largest else -(-n // -(-n // largest))
    if budget is not None:
        _check_positive(budget=budget)
        if budget < per_token:
            raise ValueError(
                f"budget={budget} bytes is below one token's logits working set ({per_token} "
                f"bytes at vocab {vocab_size}, {dtype}); raise the budget to at least that."
            )
        return min(n, budget // per_token)
    unchunked = n * vocab_size * (_dtype_bytes(dtype) + 3 * _LOSS_FP32)
    target = min(unchunked // DEFAULT_FRACTION, DEFAULT_MAX_CHUNK_BYTES)
    largest = max(target, MIN_AUTO_CHUNK_BYTES) // per_token
    largest = max(largest, MIN_AUTO_CHUNK_TOKENS)
    # equal chunks rather than full ones and a small remainder: the same peak, fewer
    # inefficient small matmuls
    chunk = -(-n // -(-n // largest))
    if chunk % 8 and chunk + 8 - chunk % 8 <= largest:
        chunk += 8 - chunk % 8  # matmul-friendly
    return max(1, min(n, chunk))


def head_kind_of(head: nn.Module) -> HeadKind:
    """Classify a head module for :func:`predict_head_loss_bytes`."""
    if any(type(p).__name__ == "Params4bit" for p in head.parameters()):
        return "4bit"
    if type(head) is nn.Linear:
        return "linear"
    return "module"


def head_compute_dtype(head: nn.Module) -> torch.dtype:
    """Dtype of the logits a head produces for input of its own precision."""
    for m in head.modules():
        compute = getattr(m, "compute_dtype", None)  # bitsandbytes Linear4bit
        if isinstance(compute, torch.dtype):
            return compute
    floats = [p.dtype for p in head.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.get_default_dtype()


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
