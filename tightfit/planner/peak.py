"""The activation peak of a checkpoint plan, with its segments on the device or the host.

A plan (:class:`~tightfit.checkpoint.plan.Segment` s, stored or checkpointed) is priced with
the per-layer terms of :mod:`tightfit.planner.activations`: :func:`plan_peak` is the
largest moment of the step's backward, :func:`offloaded_bytes` what offloaded segments keep
on the host, :func:`budget_segments` the least-recompute plan under a byte budget and
:func:`activation_peak` the plan a setup's policy names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tightfit.checkpoint.plan import (
    Segment,
    apply_offload,
    parse_policy,
    structural_segments,
    uniform_segments,
)
from tightfit.planner.activations import (
    backward_transient_bytes,
    final_norm_backward_bytes,
    final_norm_bytes,
    head_loss_bytes,
    int8_held_bytes,
    layer_backward_bytes,
    layer_input_bytes,
    layer_saved_bytes,
    quantized_backward_extra_bytes,
    recompute_inputs_bytes,
)
from tightfit.planner.train_setup import OFFLOADED, RECOMPUTED
from tightfit.planner.work import recompute_fraction

if TYPE_CHECKING:
    from tightfit.planner.presets import ModelShape
    from tightfit.planner.train_setup import TrainSetup


# -- the peak under a plan -----------------------------------------------------------


@dataclass(frozen=True)
class _Terms:
    """The bytes every plan's peak is made of, for one (shape, setup): computed once."""

    prefix: tuple[int, ...]  # prefix[i]: what layers 0..i-1 save (layer types differ: Gemma)
    backward: tuple[int, ...]  # backward[i]: layer i at the peak of its backward, recomputed
    # held[k][i]: what layers 0..i-1 hold on the device outside the saved-tensor hooks (an
    # int8 base's inputs) beyond what they save, k = 0 stored, 1 recomputed; held[1] is also
    # what any layer still holds once its backward ran, until the graph is freed
    held: tuple[tuple[int, ...], tuple[int, ...]]
    x: int  # one layer input
    dup: int  # fp32: a checkpointed segment's first norm saves its input, a view of x
    head: int
    trans: int
    extra: int  # the quantized base's extra through the layers' backward
    inputs: int  # a recomputed layer's other inputs (rotary, masks), kept for the recompute
    final_norm: int
    norm_grads: int  # the final norm's backward: the hidden gradient + two fp32 gradients

    def saved(self, start: int, stop: int) -> int:
        if stop <= start:
            return 0
        return self.prefix[stop] - self.prefix[start]

    def pinned(self, seg: Segment) -> int:
        """What ``seg``'s layers hold on the device from forward to backward, whatever the
        segment's placement (:func:`~tightfit.planner.activations.int8_held_bytes`)."""
        held = self.held[seg.kind in RECOMPUTED]
        return held[seg.stop] - held[seg.start]


def _terms(shape: ModelShape, setup: TrainSetup) -> _Terms:
    t, h = setup.tokens, shape.hidden
    # layers of one attention type save the same: compute each type once
    by_kind: dict[tuple[bool, bool], tuple[int, int]] = {}
    prefix, backward = [0], []
    held: tuple[list[int], list[int]] = ([0], [0])
    for i in range(shape.layers):
        for k in (0, 1):
            held[k].append(held[k][-1] + int8_held_bytes(shape, setup, i, recomputed=bool(k)))
        kind = (i == 0, shape.masked(i, setup.seq_len))
        if kind not in by_kind:
            by_kind[kind] = (layer_saved_bytes(shape, setup, layer=i),
                             layer_backward_bytes(shape, setup, i))
        prefix.append(prefix[-1] + by_kind[kind][0])
        backward.append(by_kind[kind][1])
    return _Terms(
        prefix=tuple(prefix),
        backward=tuple(backward),
        held=(tuple(held[0]), tuple(held[1])),
        x=layer_input_bytes(shape, setup),
        dup=t * h * 4 if setup.d == 4 else 0,
        head=head_loss_bytes(shape, setup),
        trans=backward_transient_bytes(shape, setup),
        extra=quantized_backward_extra_bytes(shape, setup),
        inputs=recompute_inputs_bytes(shape, setup),
        final_norm=final_norm_bytes(shape, setup),
        norm_grads=final_norm_backward_bytes(shape, setup),
    )


def placed(segments: tuple[Segment, ...], setup: TrainSetup) -> tuple[Segment, ...]:
    """``segments`` with ``setup.offload`` applied, as the checkpoint plan applies it
    (:func:`tightfit.checkpoint.plan.apply_offload`)."""
    return apply_offload(segments, setup.offload)


def _kept(terms: _Terms, seg: Segment) -> int:
    """Bytes ``seg`` keeps from its forward to its backward (wherever they wait)."""
    return terms.x if seg.kind in RECOMPUTED else terms.saved(seg.start, seg.stop)


def _segment_backward(setup: TrainSetup, terms: _Terms, seg: Segment, before: int,
                      prefetch: int) -> int:
    """Decoder bytes at the peak of ``seg``'s backward.

    ``before``: device bytes the segments before it keep; ``prefetch``: the previous
    segment's first bytes, brought back from the host meanwhile.

    A recomputed segment peaks in its last layer's backward, with the layers before it in
    the segment saved whole (:func:`~tightfit.planner.activations.layer_backward_bytes`,
    counted from the order backward frees them); a stored one keeps the calibrated
    transients and the quantized base's extra on top of all it saved.
    """
    s, e, x = seg.start, seg.stop, terms.x
    if seg.kind in RECOMPUTED:
        own = terms.saved(s, e - 1) + terms.backward[e - 1] - (terms.dup if s > 0 else 0)
        if setup.d != 4:
            own += (e - s - 1) * x  # 16-bit: recomputed inner layer outputs stay alive
        # its input (back on the device), its recomputed tensors, the output's gradient
        return before + x + own + prefetch + x + terms.inputs + terms.pinned(seg)
    # stored, on the device or fetched back whole (stored_offload): its saved tensors, and
    # at least its last layer's listed backward moment beside the layers before it (which
    # the calibrated transients miss once the adapters compute in 16-bit: a 4-bit weight
    # dequantized to fp32 and cast, -7.5 % on a bf16 NF4 step without it)
    calibrated = terms.extra + terms.saved(s, e) + terms.trans
    listed = terms.saved(s, e - 1) + terms.backward[e - 1]
    return before + max(calibrated, listed) + prefetch + x + terms.pinned(seg)


def plan_peak(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...],
              terms: _Terms | None = None) -> tuple[int, int]:
    """``(layers, head)``: bytes of the decoder and of the head + loss at the step's peak.

    The peak is the largest of (1) the start of backward — every stored segment's saved
    tensors, every checkpointed segment's input, and the head + loss at its peak —, (2) the
    final norm's backward right after, and (3) each segment's backward — the segments before
    it, its own input, its recomputed saved tensors and the backward transients.

    Offloaded segments (kinds ``checkpoint_offload`` / ``stored_offload``, or made so by
    ``setup.offload``: :func:`placed`) keep their bytes on the host: the device holds
    only the segment whose backward runs (its input or saved tensors brought back) and the
    previous segment's, prefetched one segment ahead — never the other segments'.

    Args:
        shape: The architecture.
        setup: The pieces and the batch.
        segments: The plan's segments (:class:`~tightfit.checkpoint.plan.Segment`), in
            order over the layers, each ``"stored"`` or ``"checkpoint"`` (or their
            ``_offload`` kinds).
        terms: The setup's byte terms, when the caller evaluates many plans of one setup.

    Raises:
        ValueError: A ``"selective"`` segment (the planner does not model it).
    """
    if any(seg.kind not in ("stored", *RECOMPUTED, *OFFLOADED) for seg in segments):
        raise ValueError("selective checkpoint segments are not modelled by the planner; pass "
                         "stored / checkpoint segments (policies none, every, sqrt, uniform:k, "
                         "budget), offloaded or not.")
    t = terms or _terms(shape, setup)
    segments = placed(segments, setup)
    on_device = [(0 if seg.kind in OFFLOADED else _kept(t, seg)) + t.pinned(seg)
                 for seg in segments]
    # what is fetched back one segment ahead: an input, or a segment's saved tensors whole
    ahead = [_kept(t, seg) if seg.kind in OFFLOADED else 0 for seg in segments]
    # the last segment's first bytes come back while the head and the final norm run backward
    last = ahead[-1] if segments else 0
    start_of_backward = sum(on_device) + t.final_norm + last
    best_layers, best_head = start_of_backward, t.head
    # the final RMSNorm's backward, once the head is done (visible when a chunked head keeps
    # the head small)
    norm_backward = start_of_backward + t.extra + t.norm_grads
    if norm_backward > best_layers + best_head:
        best_layers, best_head = norm_backward, 0
    before = 0
    for j, seg in enumerate(segments):
        prefetch = ahead[j - 1] if j > 0 else 0
        # the layers whose backward already ran still hold what the saved-tensor hooks never
        # saw: the graph (the loss's) lives until backward returns
        done = t.held[1][-1] - t.held[1][seg.stop]
        layers = _segment_backward(setup, t, seg, before, prefetch) + done
        if layers > best_layers + best_head:
            best_layers, best_head = layers, 0
        before += on_device[j]
    return best_layers, best_head


def offloaded_bytes(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...]) -> int:
    """Host bytes the offloaded segments keep between forward and backward.

    ``inputs``: one layer input (T·h·d) per checkpointed segment; ``all``: also every stored
    segment's saved tensors. Each of these bytes crosses the link twice per step.
    """
    t = _terms(shape, setup)
    return sum(_kept(t, seg) for seg in placed(segments, setup) if seg.kind in OFFLOADED)


def budget_segments(shape: ModelShape, setup: TrainSetup, budget: int) -> tuple[Segment, ...] | None:
    """The least-recompute plan whose predicted activation peak fits ``budget``.

    Layers of one architecture are equal, so a plan is characterized by how many layers
    stay stored (kept first, no recompute) and how long the checkpointed segments are;
    enumerate both (O(L²)) and keep the fitting plan with the most stored layers, ties
    going to the lower peak. ``None`` when not even every-layer checkpointing fits.
    """
    n = shape.layers
    terms = _terms(shape, setup)
    best: tuple[int, int, tuple[Segment, ...]] | None = None
    for k in range(1, n + 1):
        # fewer stored layers than the best plan so far cannot win: stop the scan there
        floor = 0 if best is None else -best[0]
        for stored in range(n, floor - 1, -1):
            if stored and setup.offload != "all" and (
                    terms.saved(0, stored) + terms.extra + terms.trans + terms.x > budget):
                continue  # the stored segment's own backward already exceeds the budget
            rest = n - stored
            segs = [Segment(0, stored, "stored")] if stored else []
            if rest:
                segs += [Segment(stored + c.start, stored + c.stop, "checkpoint")
                         for c in uniform_segments(rest, math.ceil(rest / k))]
            layers, head = plan_peak(shape, setup, tuple(segs), terms)
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

    The segments carry their placement (:func:`placed`).

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
    segments = placed(segments, setup)
    layers, head = plan_peak(shape, setup, segments)
    return layers, head, segments, recompute_fraction(shape, setup, segments)
