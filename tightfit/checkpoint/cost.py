"""The peak model: a plan's predicted peak bytes, recompute and move time, from a profile.

A plan differs from the profiled (unchecked) step only in what its segments keep on the
device, so every phase of the profiled step is shifted by the bytes the plan drops before it:

* a checkpointed segment ``s..e`` keeps its input ``x_s`` (and, when selective, the matmul/
  attention outputs) instead of its blocks' saved bytes; call the difference its savings;
* forward of block ``m`` and the tail (head + loss, forward and backward) peak at the
  profiled peak minus the savings of every block before them;
* backward of a stored block: its profiled peak minus the savings before it;
* backward of a checkpointed segment: the segment is first recomputed block by block on top
  of what is live (its blocks' saved bytes come back), then its blocks' backward peaks are
  the profiled ones minus the savings before the segment, plus ``x_s`` when the block does
  not save its own input.

Offloaded segments (``stored_offload``: the storages its blocks save; ``checkpoint_offload``:
the input ``x_s``) add their offloaded bytes to their savings, but those bytes are on the
device during the segment itself and during the **next** segment (the tail after the last
one), in forward and in backward alike: in forward their writes to the next tier overlap
the next segment's forward and are retired when the one after it starts; in backward they
are prefetched when the next segment's backward starts (one segment ahead). So the segment
after an offloaded one sees ``S_before - offloaded``. The mechanism
(:mod:`tightfit.checkpoint.offload`) keeps exactly that schedule.

Storages the blocks are passed besides their first argument (rotary tables, position ids,
masks: the same tensors for every block) are never dropped: a stored block that saves them
keeps them, and a checkpoint frame records its blocks' calls for the replay, which keeps
them too. So a checkpointed block's savings leave out the ones it saves
(``BlockCost.shared_saved_bytes``: the profile credits the first block that saves the rotary
tables with them), and the first checkpoint frame of a plan keeps the ones no block saves
(``Profile.frame_bytes``) from its segment on, until its backward — after every later
segment's. They are charged from that segment's peak on; in the chain's forward they were
alive in the profiled step too, so there the charge is high by those bytes (a few bytes a
token: the position ids), exact in the tail and the backward.

Each segment therefore has a constant ``c`` with the constraint
``c - (S_before - offloaded_prev) ≤ budget``, where ``S_before`` is the savings of the
segments before it (less ``frame_bytes`` once a frame came) and ``offloaded_prev`` the bytes
the previous segment offloaded. That is what makes the solver
(:mod:`tightfit.checkpoint.solver`) an exact DP (with one flag: has a frame come yet).

Time: a checkpointed segment costs its blocks' forward time (the recompute). Moving a
segment's ``B`` offloaded bytes costs ``m = latency + B / bandwidth`` each way (both measured
through the copy engine: ``OffloadTier``). On the CPU that is charged whole, ``2 m``. Where
moves overlap with compute (CUDA's copy engines), the write is charged ``max(0, m - F_next)``
and the prefetch ``max(0, m - G_next)``, with ``F_next`` the forward time of the next segment
(the tail's after the last) and ``G_next`` its backward time plus its recompute. Backward times are not profiled per
block: a block's is its forward time × the profiled step's backward ÷ forward ratio. On the
CPU the copy thread shares the cores with the compute, so nothing is credited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.plan import (
    MIN_OFFLOAD_BYTES,
    OffloadTier,
    Segment,
    SegmentKind,
    offload_sizes,
)
from tightfit.tiers.regions import aligned


@dataclass(frozen=True)
class SegmentCost:
    """``peak_const - (savings_before - offloaded_prev)`` is the segment's peak.

    Attributes:
        peak_const: The segment's peak with nothing dropped before it.
        savings: What it drops for the segments after the next (its offloaded bytes
            included; the next segment still sees those on the device).
        recompute_s: Forward time of its recompute.
        offload_bytes: Device bytes it places on the next tier.
        host_bytes: What they take there (page rounded).
        forward_s: Its forward time (what the previous segment's write hides behind).
        backward_s: Its backward time, recompute included (what the previous segment's
            prefetch hides behind).
        frame: It is a checkpoint frame (it records its blocks' calls until its backward,
            so the profile's ``frame_bytes`` are alive from it on).
    """

    peak_const: int
    savings: int
    recompute_s: float
    offload_bytes: int = 0
    host_bytes: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    frame: bool = False


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted device peak, recompute and unhidden move time, and host bytes."""

    peak_bytes: int
    recompute_s: float
    move_s: float
    host_bytes: int


def backward_ratio(prof: Profile) -> float:
    """Backward ÷ forward time of the profiled step (what a block's backward is estimated at)."""
    fwd = sum(b.forward_s for b in prof.blocks) + prof.tail_forward_s
    return max(prof.step_s - fwd, 0.0) / fwd if fwd > 0 else 2.0


def segment_cost(prof: Profile, start: int, stop: int, kind: SegmentKind,
                 min_bytes: int = MIN_OFFLOAD_BYTES) -> SegmentCost:
    """Cost constants of blocks ``start .. stop - 1`` run as one segment of ``kind``.

    ``min_bytes``: saved storages smaller than this are not offloaded.
    """
    bl = prof.blocks
    fwd = sum(b.forward_s for b in bl[start:stop])
    bwd = backward_ratio(prof) * fwd
    if kind in ("stored", "stored_offload") or not any(b.saved_tensors for b in bl[start:stop]):
        # nothing saved means nothing to recompute: torch's frame keeps no input either
        peak = max(max(b.fwd_peak_bytes, b.bwd_peak_bytes) for b in bl[start:stop])
        sizes = offload_sizes(prof, Segment(start, stop, kind), min_bytes) \
            if kind == "stored_offload" else []
        return SegmentCost(peak, sum(sizes), 0.0, sum(sizes), sum(map(aligned, sizes)), fwd, bwd)
    sel = kind == "selective"
    first = bl[start]
    kept_input = 0 if first.saves_input else first.input_bytes
    peak = 0
    dropped = 0  # savings of the segment's blocks before block m
    recomputed = 0  # bytes the recompute has brought back before block m
    recompute_peak = 0
    recompute_s = 0.0
    for m in range(start, stop):
        b = bl[m]
        kept = b.selective_bytes if sel else 0
        extra = b.selective_unsaved_bytes if sel else 0  # kept although autograd wouldn't
        # the frame holds the input through the segment's forward, offloaded or not; the
        # block's other arguments it saves stay (later blocks and the frame hold them)
        own = b.saved_bytes - b.shared_saved_bytes
        d = own - kept - (first.input_bytes if m == start else 0)
        peak = max(peak, b.fwd_peak_bytes - dropped + extra, b.bwd_peak_bytes + kept_input + extra)
        # a selective recompute takes the kept outputs from torch's cache, not new memory
        recompute_peak = max(recompute_peak,
                             recomputed + b.fwd_peak_bytes - b.fwd_start_bytes - kept)
        recomputed += own - (kept - extra)
        dropped += d
        recompute_s += b.forward_s - (b.selective_forward_s if sel else 0.0)
    last = bl[stop - 1]
    peak = max(peak, last.bwd_start_bytes - dropped + recompute_peak)
    moved = sum(offload_sizes(prof, Segment(start, stop, kind), min_bytes))
    recompute_s = max(recompute_s, 0.0)
    return SegmentCost(peak, dropped + moved, recompute_s, moved, aligned(moved) if moved else 0,
                       fwd, bwd + recompute_s, frame=True)


def tail_cost(prof: Profile) -> SegmentCost:
    """The tail (head + loss) as the segment after the chain: its peak and times."""
    return SegmentCost(prof.tail_peak_bytes, 0, 0.0, forward_s=prof.tail_forward_s,
                       backward_s=backward_ratio(prof) * prof.tail_forward_s)


def move_seconds(offloaded: SegmentCost, following: SegmentCost, tier: OffloadTier) -> float:
    """Unhidden time of moving ``offloaded``'s bytes out and back, with ``following`` the
    segment (or tail) whose forward hides the write and whose backward hides the prefetch."""
    if not offloaded.offload_bytes:
        return 0.0
    if not tier.bandwidth:
        return float("inf")
    one_way = tier.latency_s + offloaded.offload_bytes / tier.bandwidth
    if not tier.overlap:
        return 2 * one_way
    return max(0.0, one_way - following.forward_s) + max(0.0, one_way - following.backward_s)


def predict(prof: Profile, segments: Sequence[Segment], tier: OffloadTier | None = None,
            ) -> Prediction:
    """Predicted peak, recompute, unhidden moves and host bytes of a plan's ``segments``.

    Without ``tier`` nothing is offloaded (offload kinds cost as their plain kinds).
    """
    min_bytes = tier.min_bytes if tier is not None else 1 << 62
    peak = prof.prefix_peak_bytes
    savings = 0
    recompute = move = 0.0
    host = 0
    prev: SegmentCost | None = None
    framed = False
    for seg in segments:
        c = segment_cost(prof, seg.start, seg.stop, seg.kind, min_bytes)
        if c.frame and not framed:  # the first frame keeps the blocks' unsaved arguments
            savings -= prof.frame_bytes
            framed = True
        held = prev.offload_bytes if prev is not None else 0
        peak = max(peak, c.peak_const - (savings - held))
        if prev is not None and tier is not None:
            move += move_seconds(prev, c, tier)
        savings += c.savings
        recompute += c.recompute_s
        host += c.host_bytes
        prev = c
    tail = tail_cost(prof)
    held = prev.offload_bytes if prev is not None else 0
    peak = max(peak, tail.peak_const - (savings - held))
    if prev is not None and tier is not None:
        move += move_seconds(prev, tail, tier)
    return Prediction(int(peak), recompute, move, host)
