"""Cross-entropy of an LM head computed a chunk of tokens at a time.

The full ``[tokens, vocab]`` logits of a causal LM (and their fp32 copies in the softmax and
in backward) are often the largest activation of a fine-tuning step. Here the head and the
loss run on ``chunk_tokens`` rows at a time, so only one chunk of logits is ever alive.

Two strategies, same numbers:

* ``"precompute"`` (default): a custom autograd Function that, in forward, computes each
  chunk's loss *and* its gradients (w.r.t. the hidden states and the head's trainable
  parameters) and frees the chunk's logits before the next chunk; backward only scales the
  stored gradients. The head runs forward once and backward once — the same work as the
  unchunked loss — which is why it is the default (the Liger-Kernel "fused linear
  cross-entropy" idea, done with torch's own ops so any head module works).
* ``"recompute"``: each chunk under non-reentrant ``torch.utils.checkpoint``; the chunk's
  logits are recomputed in backward. One extra head forward per step; kept for comparison
  and for callers who must not compute gradients in forward (e.g. forward-only probes that
  still need a graph).

The loss is HF's ``ForCausalLMLoss``: logits upcast to fp32, the summed cross-entropy
divided by the number of non-ignored labels (or by ``num_items_in_batch``), labels padded
with ``ignore_index`` and shifted left by one. ``"recompute"`` calls ``F.cross_entropy``
itself; ``"precompute"`` computes the same math in place in one fp32 buffer per chunk
(log-sum-exp for the loss, softmax minus one-hot for the gradient; see :func:`_xent_`).
A :class:`~tightfit.loss.transform.LogitTransform` (Gemma 2's soft-cap, Cohere's and
Granite's scales) is applied to each chunk's fp32 logits before the loss.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from tightfit.loss.transform import LogitTransform

Strategy = Literal["precompute", "recompute"]


def chunked_cross_entropy(
    hidden: Tensor,
    head: nn.Module,
    labels: Tensor,
    *,
    chunk_tokens: int,
    ignore_index: int = -100,
    shift: bool = True,
    num_items_in_batch: Tensor | int | None = None,
    strategy: Strategy = "precompute",
    transform: LogitTransform | None = None,
) -> Tensor:
    """Mean token cross-entropy of ``head(hidden)`` against ``labels``, one chunk at a time.

    Equal (up to float summation order) to HF's
    ``ForCausalLMLoss(head(hidden), labels, vocab_size, num_items_in_batch, ignore_index)``,
    with the same gradients, but the logits of only ``chunk_tokens`` tokens exist at once.

    Args:
        hidden: Final hidden states, ``[..., seq, hidden]`` (any float dtype; the loss is
            accumulated in fp32 like HF does).
        head: The output head: ``nn.Linear`` (tied or not), a peft LoRA-wrapped Linear, a
            bitsandbytes ``Linear4bit``, or any module mapping ``[n, hidden] -> [n, vocab]``.
        labels: Token ids, shape ``hidden.shape[:-1]``; ``ignore_index`` marks tokens to skip.
        chunk_tokens: Tokens per chunk (rows of ``hidden`` after flattening), ``>= 1``.
        ignore_index: Label value that contributes neither loss nor gradient.
        shift: ``True`` (HF causal LMs): position ``t`` predicts ``labels[..., t + 1]`` and the
            last position is ignored. ``False``: ``labels`` are already aligned with
            ``hidden`` (HF's ``shift_labels``).
        num_items_in_batch: As in HF: when given, the loss is the sum over tokens divided by
            this number (gradient accumulation); otherwise the mean over non-ignored tokens.
        strategy: ``"precompute"`` (gradients computed per chunk in forward) or
            ``"recompute"`` (checkpointed chunks, logits recomputed in backward).
        transform: Applied to the logits before the loss (e.g. Gemma 2's soft-cap), in fp32
            per chunk; the model applies it in its own dtype, so below fp32 the chunked
            loss rounds less than the model does.

    Returns:
        A 0-dim fp32 loss. When every label is ignored and ``num_items_in_batch`` is
        ``None`` this is NaN (0/0), exactly as HF's mean reduction gives, and every gradient
        is zero, again as in HF.

    Raises:
        TypeError: ``head`` is not a module or ``chunk_tokens`` is not an int.
        ValueError: shapes disagree, or ``chunk_tokens < 1``, or an unknown ``strategy``.
    """
    _validate(hidden, head, labels, chunk_tokens, strategy)
    tf = transform if transform is not None and not transform.identity else None
    flat_labels = _aligned_labels(labels, ignore_index, shift).to(hidden.device)
    # HF divides the summed loss by the count of valid labels (mean) or by
    # num_items_in_batch; a 0-dim fp32 tensor either way (no host sync, 0/0 stays NaN).
    if num_items_in_batch is None:
        denom = (flat_labels != ignore_index).sum().to(torch.float32)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    params = [p for p in head.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or bool(params))
    if not needs_grad:
        with torch.no_grad():
            return _forward_only(hidden, head, flat_labels, denom, chunk_tokens, ignore_index, tf)
    if strategy == "recompute":
        return _recompute(hidden, head, flat_labels, denom, chunk_tokens, ignore_index, tf)
    return _PrecomputedChunkLoss.apply(
        hidden, flat_labels, denom, head, chunk_tokens, ignore_index, tf, *params
    )


def _validate(
    hidden: Tensor, head: nn.Module, labels: Tensor, chunk_tokens: int, strategy: str
) -> None:
    if not isinstance(head, nn.Module):
        raise TypeError(f"head must be an nn.Module (e.g. model.lm_head), got {type(head)}.")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(
            f"chunk_tokens must be an int, got {chunk_tokens!r}; use "
            "tightfit.loss.auto_chunk_tokens(...) to pick one."
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    if hidden.dim() < 2 or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a float tensor [..., seq, hidden], got shape {tuple(hidden.shape)} "
            f"and dtype {hidden.dtype}."
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}; pass the labels that go with these hidden states."
        )
    if strategy not in ("precompute", "recompute"):
        raise ValueError(f"strategy must be 'precompute' or 'recompute', got {strategy!r}.")


def _aligned_labels(labels: Tensor, ignore_index: int, shift: bool) -> Tensor:
    """Labels aligned with the flattened hidden rows, as HF's ``ForCausalLMLoss`` builds them."""
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return labels.reshape(-1)


def _chunk_sum_loss(
    logits: Tensor, labels: Tensor, denom: Tensor, ignore_index: int, tf: LogitTransform | None
) -> Tensor:
    # HF: logits.float() then cross_entropy; "sum" over a chunk then / denom equals HF's mean
    # (sum / number of valid tokens) once the chunks are added up.
    x = logits.float() if tf is None else tf(logits.float())
    loss = F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="sum")
    return loss / denom


def _chunks(n: int, chunk_tokens: int) -> range:
    return range(0, n, chunk_tokens)


def _forward_only(
    hidden: Tensor, head: nn.Module, labels: Tensor, denom: Tensor, chunk: int, ii: int,
    tf: LogitTransform | None,
) -> Tensor:
    h = hidden.reshape(-1, hidden.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s in _chunks(h.shape[0], chunk):
        x = _fp32_logits(head(h[s : s + chunk]))
        if tf is not None:
            tf.apply_(x)
        total += _xent_(x, labels[s : s + chunk], denom, ii, want_grad=False)
    return total


def _recompute(
    hidden: Tensor, head: nn.Module, labels: Tensor, denom: Tensor, chunk: int, ii: int,
    tf: LogitTransform | None,
) -> Tensor:
    h = hidden.reshape(-1, hidden.shape[-1])

    def chunk_loss(h_c: Tensor, y_c: Tensor) -> Tensor:
        return _chunk_sum_loss(head(h_c), y_c, denom, ii, tf)

    # torch.split (not slicing) so backward gathers the chunk grads with one cat instead of a
    # full-size zero tensor per chunk.
    h_chunks = torch.split(h, chunk)
    y_chunks = torch.split(labels, chunk)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h_c, y_c in zip(h_chunks, y_chunks):
        total = total + checkpoint(chunk_loss, h_c, y_c, use_reentrant=False)
    return total


def _is_plain_linear(head: nn.Module) -> bool:
    """A bare ``nn.Linear``: its gradients are two matmuls we can write into our buffers."""
    return (
        type(head) is nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not parametrize.is_parametrized(head)
    )


def _xent_(x: Tensor, y: Tensor, denom: Tensor, ii: int, want_grad: bool) -> Tensor:
    """Cross-entropy of fp32 logits ``x`` ``[n, V]``, overwriting ``x`` with its gradient.

    The same math as ``F.cross_entropy(x, y, reduction="sum") / denom`` and its backward
    (softmax minus one-hot, ignored rows zero, scaled by ``1 / denom``), but in place: one
    ``[n, V]`` fp32 buffer instead of the four (logits, log-softmax, NLL grad, softmax grad)
    that autograd holds, so a chunk can be four times as long for the same memory.
    """
    valid = y != ii
    idx = torch.where(valid, y, torch.zeros_like(y)).unsqueeze(1)
    target = x.gather(1, idx).squeeze(1)
    m = x.amax(1, keepdim=True)
    x.sub_(m).exp_()
    s = x.sum(1, keepdim=True)
    lse = s.log().add_(m).squeeze(1)
    # where, not a multiply: an ignored row's lse may be inf/NaN and must not leak into the sum
    loss = torch.where(valid, lse - target, 0.0).sum() / denom
    if want_grad:
        # ignored rows -> 0 (and no 0 * inf = NaN when every label is ignored, as in HF);
        # softmax normalization and loss scale in one pass over x
        scale = torch.where(valid, 1.0 / denom, 0.0).unsqueeze(1)
        x.mul_(scale / s)
        x.scatter_add_(1, idx, -scale)
    return loss


def _transformed_xent_(
    x: Tensor, y: Tensor, denom: Tensor, ii: int, tf: LogitTransform | None
) -> Tensor:
    """:func:`_xent_` of ``tf(x)``, leaving in ``x`` the gradient w.r.t. the raw logits."""
    saved = tf.apply_(x) if tf is not None else None
    loss = _xent_(x, y, denom, ii, want_grad=True)
    if tf is not None:
        tf.grad_(x, saved)
    return loss


class _PrecomputedChunkLoss(torch.autograd.Function):
    """Loss and gradients per chunk in forward; backward scales the stored gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        labels: Tensor,
        denom: Tensor,
        head: nn.Module,
        chunk: int,
        ignore_index: int,
        tf: LogitTransform | None,
        *params: Tensor,
    ) -> Tensor:
        h = hidden.detach().reshape(-1, hidden.shape[-1])
        grad_h = torch.empty_like(h) if hidden.requires_grad else None
        # fp32 accumulators for the parameter gradients: a bf16 running sum over chunks would
        # round once per chunk, where HF's single matmul rounds once in total.
        acc: list[Tensor | None] = [None] * len(params)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # under autocast the matmul dtypes are autocast's to choose: go through autograd
        autocast = torch.is_autocast_enabled(h.device.type)
        step = _linear_chunk if _is_plain_linear(head) and not autocast else _module_chunk
        for s in _chunks(h.shape[0], chunk):
            total += step(head, h, labels, s, chunk, denom, ignore_index, tf, grad_h, params, acc)
        grads = [
            a if a is not None else torch.zeros_like(p, dtype=torch.float32)
            for a, p in zip(acc, params)
        ]
        ctx.hidden_shape = hidden.shape
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(grad_h, *grads)
        return total

    @staticmethod
    @once_differentiable  # the stored gradients are constants: no double backward
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_h, *grads = ctx.saved_tensors
        # In place: these buffers belong to this node alone (a second backward through the
        # same graph is refused by the saved-tensor version check).
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype)).view(ctx.hidden_shape)
        out = [g.mul_(grad_out).to(dt) for g, dt in zip(grads, ctx.param_dtypes)]
        return (grad_h, None, None, None, None, None, None, *out)


def _accumulate(acc: list[Tensor | None], i: int, g: Tensor) -> None:
    if acc[i] is None:
        acc[i] = g if g.dtype == torch.float32 else g.float()
    else:
        acc[i].add_(g)


def _fp32_logits(logits: Tensor) -> Tensor:
    # HF upcasts with logits.float(); for fp32 logits that is the same buffer, which we may
    # overwrite because nothing else holds it.
    return logits if logits.dtype == torch.float32 else logits.float()


def _linear_chunk(
    head: nn.Linear,
    h: Tensor,
    labels: Tensor,
    start: int,
    chunk: int,
    denom: Tensor,
    ii: int,
    tf: LogitTransform | None,
    grad_h: Tensor | None,
    params: tuple[Tensor, ...],
    acc: list[Tensor | None],
) -> Tensor:
    """Plain Linear head: logits, in-place loss gradient, then the two gradient matmuls
    written straight into the hidden-gradient rows and the fp32 weight accumulator."""
    h_c, y_c = h[start : start + chunk], labels[start : start + chunk]
    w, b = head.weight, head.bias
    x = _fp32_logits(F.linear(h_c, w, b))  # a bf16 original is freed here, only x remains
    loss_c = _transformed_xent_(x, y_c, denom, ii, tf)
    g = x if x.dtype == w.dtype else x.to(w.dtype)
    del x
    if grad_h is not None:
        torch.mm(g, w, out=grad_h[start : start + g.shape[0]])
    for i, p in enumerate(params):
        if p is w:
            if acc[i] is not None and g.dtype == torch.float32:
                acc[i].addmm_(g.t(), h_c)  # straight into the accumulator, no temporary
            else:
                _accumulate(acc, i, torch.mm(g.t(), h_c))
        elif p is b:
            _accumulate(acc, i, g.sum(0, dtype=torch.float32))
    return loss_c


def _module_chunk(
    head: nn.Module,
    h: Tensor,
    labels: Tensor,
    start: int,
    chunk: int,
    denom: Tensor,
    ii: int,
    tf: LogitTransform | None,
    grad_h: Tensor | None,
    params: tuple[Tensor, ...],
    acc: list[Tensor | None],
) -> Tensor:
    """Any head module (LoRA, 4-bit, ...): its forward under autograd, the loss gradient in
    place, then autograd back through the module for this chunk."""
    h_c, y_c = h[start : start + chunk], labels[start : start + chunk]
    with torch.enable_grad():
        x_in = h_c.detach().requires_grad_(grad_h is not None)
        logits = head(x_in)
    x = _fp32_logits(logits.detach())
    loss_c = _transformed_xent_(x, y_c, denom, ii, tf)
    g = x if x.dtype == logits.dtype else x.to(logits.dtype)
    del x
    inputs = ([x_in] if grad_h is not None else []) + list(params)
    grads = torch.autograd.grad(logits, inputs, grad_outputs=g, allow_unused=True)
    del logits, g
    if grad_h is not None:
        grad_h[start : start + h_c.shape[0]].copy_(grads[0])
        grads = grads[1:]
    for i, g_p in enumerate(grads):
        if g_p is not None:
            _accumulate(acc, i, g_p)
    return loss_c
