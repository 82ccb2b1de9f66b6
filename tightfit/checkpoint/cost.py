"""The peak model: a plan's predicted peak bytes and recompute time, from a profile.

A plan differs from the profiled (unchecked) step only in what its checkpointed blocks keep,
so every phase of the profiled step is shifted by the bytes the plan drops before it:

* a checkpointed segment ``s..e`` keeps its input ``x_s`` (and, when selective, the matmul/
  attention outputs) instead of its blocks' saved bytes; call the difference its savings;
* forward of block ``m`` and the tail (head + loss, forward and backward) peak at the
  profiled peak minus the savings of every block before them;
* backward of a stored block: its profiled peak minus the savings before it;
* backward of a checkpointed segment: the segment is first recomputed block by block on top
  of what is live (its blocks' saved bytes come back), then its blocks' backward peaks are
  the profiled ones minus the savings before the segment, plus ``x_s`` when the block does
  not save its own input.

Each segment therefore has a constant ``c`` with the constraint ``c - S_before ≤ budget``,
where ``S_before`` is the savings of the segments before it. That is what makes the solver
(:mod:`tightfit.checkpoint.solver`) an exact DP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.plan import Segment, SegmentKind


@dataclass(frozen=True)
class SegmentCost:
    """``peak_const - savings_before`` is the segment's peak; ``savings`` what it drops."""

    peak_const: int
    savings: int
    recompute_s: float


def segment_cost(prof: Profile, start: int, stop: int, kind: SegmentKind,
                 offload: bool = False) -> SegmentCost:
    """Cost constants of blocks ``start .. stop - 1`` run as one segment of ``kind``.

    With ``offload`` on a CUDA profile the segment's input waits on the host until its
    backward, so it costs no device bytes until then.
    """
    bl = prof.blocks
    if kind == "stored" or not any(b.saved_tensors for b in bl[start:stop]):
        # nothing saved means nothing to recompute: torch's frame keeps no input either
        peak = max(max(b.fwd_peak_bytes, b.bwd_peak_bytes) for b in bl[start:stop])
        return SegmentCost(peak, 0, 0.0)
    sel = kind == "selective"
    first = bl[start]
    kept_input = 0 if first.saves_input else first.input_bytes
    parked = offload and prof.device.startswith("cuda")
    held_input = 0 if parked else first.input_bytes  # device bytes the input holds in forward
    peak = 0
    dropped = 0  # savings of the segment's blocks before block m
    recomputed = 0  # bytes the recompute has brought back before block m
    recompute_peak = 0
    recompute_s = 0.0
    for m in range(start, stop):
        b = bl[m]
        kept = b.selective_bytes if sel else 0
        extra = b.selective_unsaved_bytes if sel else 0  # kept although autograd wouldn't
        d = b.saved_bytes - kept - (held_input if m == start else 0)
        peak = max(peak, b.fwd_peak_bytes - dropped + extra, b.bwd_peak_bytes + kept_input + extra)
        # a selective recompute takes the kept outputs from torch's cache, not new memory
        recompute_peak = max(recompute_peak,
                             recomputed + b.fwd_peak_bytes - b.fwd_start_bytes - kept)
        recomputed += b.saved_bytes - (kept - extra)
        dropped += d
        recompute_s += b.forward_s - (b.selective_forward_s if sel else 0.0)
    last = bl[stop - 1]
    peak = max(peak, last.bwd_start_bytes - dropped + recompute_peak)
    return SegmentCost(peak, dropped, max(recompute_s, 0.0))


def predict(prof: Profile, segments: Sequence[Segment], offload: bool = False,
            ) -> tuple[int, float]:
    """Predicted peak bytes and recompute seconds of a plan's ``segments``."""
    peak = prof.prefix_peak_bytes
    savings = 0
    recompute = 0.0
    for seg in segments:
        c = segment_cost(prof, seg.start, seg.stop, seg.kind, offload)
        peak = max(peak, c.peak_const - savings)
        savings += c.savings
        recompute += c.recompute_s
    peak = max(peak, prof.tail_peak_bytes - savings)
    return peak, recompute
