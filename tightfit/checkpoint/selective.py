"""Selective recompute: inside a checkpointed block keep the expensive outputs.

Matmuls and attention are most of a block's time but a minority of its saved bytes; the
elementwise ops around them (norms, activations, residual adds, rotary) are cheap to redo.
The policy goes through torch's own selective-checkpoint contexts.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _ops() -> frozenset:
    names = [
        "mm", "bmm", "addmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    ]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAVED_OPS: frozenset = _ops()
"""The aten ops whose outputs a selective segment keeps instead of recomputing."""


def _policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_context_fn = functools.partial(create_selective_checkpoint_contexts, _policy)
"""``context_fn`` for torch's non-reentrant checkpoint that saves :data:`SAVED_OPS`."""
