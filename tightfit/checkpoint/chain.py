"""What a profile measured of the chain: per block and for the prefix and tail around it.

The data the plans, the peak model (:mod:`tightfit.checkpoint.cost`) and the solver work on;
:func:`tightfit.checkpoint.profile.profile` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """What one block costs in a step without checkpointing (bytes are above step start).

    Attributes:
        input_bytes: The block's input (the hidden state the chain carries).
        saved_bytes: Storages it saves for backward that nothing before it saved (its input
            included when it saves it) — what checkpointing it drops.
        saves_input: Whether the block itself saves its input.
        saved_tensors: How many tensors (weights included) it saves for backward. A
            checkpoint of blocks that save none keeps nothing and is never recomputed.
        selective_bytes: What a selective checkpoint keeps: every output of a matmul or
            attention op in the block (torch caches them all, saved for backward or not).
        selective_unsaved_bytes: The part of ``selective_bytes`` autograd would not save.
        forward_s: Forward time — the cost of recomputing the block.
        selective_forward_s: Time of the ops a selective checkpoint does not recompute
            (``forward_s`` times those ops' share of the block's op time).
        fwd_start_bytes / fwd_peak_bytes: Live bytes when its forward starts / at its peak.
        bwd_start_bytes / bwd_peak_bytes: The same for its backward.
        saved_sizes: Bytes of each storage in ``saved_bytes``, largest first, less those the
            block was passed as arguments besides its first (rotary tables, masks: shared by
            every block, so moving one block's save frees nothing) — what offloading the
            block's saved tensors moves (see ``tightfit.checkpoint.plan.offload_sizes``);
            ``None`` when not measured (then ``saved_bytes`` counts as one storage).
        shared_saved_bytes: The part of ``saved_bytes`` that is the tensors the block was
            passed besides its first argument (rotary tables, masks): every block and every
            checkpoint frame holds those, so no placement of this block drops them.
    """

    input_bytes: int
    saved_bytes: int
    saves_input: bool
    saved_tensors: int
    selective_bytes: int
    selective_unsaved_bytes: int
    forward_s: float
    selective_forward_s: float
    fwd_start_bytes: int
    fwd_peak_bytes: int
    bwd_start_bytes: int
    bwd_peak_bytes: int
    saved_sizes: tuple[int, ...] | None = None
    shared_saved_bytes: int = 0


@dataclass(frozen=True)
class Profile:
    """Measurements of one step of ``model`` on one example batch, without checkpointing.

    Attributes:
        blocks: One :class:`BlockCost` per block, in forward order.
        prefix_peak_bytes: Peak before the first block (embeddings, masks, rotary tables).
        tail_peak_bytes: Peak from the last block's output to the loss and back (head + loss).
        tail_saved_bytes: Bytes the tail saves for backward.
        tail_forward_s: Forward time of the tail.
        step_s: Forward + backward time of the step.
        peak_bytes: Measured peak of the whole step.
        device: Where it was measured.
        frame_bytes: Storages the blocks are passed besides their first argument that no
            block saves (position ids): a checkpoint frame records its blocks' calls for the
            replay, so in a plan with one they stay alive until that frame's backward.
    """

    blocks: tuple[BlockCost, ...]
    prefix_peak_bytes: int
    tail_peak_bytes: int
    tail_saved_bytes: int
    tail_forward_s: float
    step_s: float
    peak_bytes: int
    device: str
    frame_bytes: int = 0
