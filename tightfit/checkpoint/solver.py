"""The budget solver: the least modelled time whose predicted peak fits, exactly, by DP.

Segments it chooses from, per placement allowed (``offload``): stored blocks, checkpointed
runs of consecutive blocks, and with offload their ``stored_offload`` / ``checkpoint_offload``
versions; with ``allow_selective=True`` also one-block selective checkpoints. Selective is off
by default: its peak prediction is the least exact one (measured 1–3 % off either way, torch's
selective cache keeps a little the profile does not see), and a budget plan must fit.

With the peak model of :mod:`tightfit.checkpoint.cost`, a segment's feasibility depends only
on the savings ``S`` of the segments before it (more is always better), on the bytes the
previous segment offloaded (still on the device during this one; fewer is better) and, for
the host budget, on the host bytes so far (fewer is better); time adds up, a move's charged
once the segment after it is known. So a DP over block boundaries that keeps, per boundary,
the Pareto front of (time, savings, previous offload, host bytes) over feasible prefixes
finds the optimum. One flag more: whether a checkpoint frame came yet (the first one keeps
the blocks' unsaved arguments, ``Profile.frame_bytes``, from then on). The smallest feasible peak comes from the same DP with the running peak
in place of time.
"""

from __future__ import annotations

from typing import Literal

from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.cost import (
    SegmentCost,
    move_seconds,
    predict,
    segment_cost,
    tail_cost,
)
from tightfit.checkpoint.plan import (
    OffloadMode,
    OffloadTier,
    Plan,
    Segment,
    apply_offload,
    parse_policy,
    structural_segments,
)

_MIB = 1024 * 1024
_FRONT_CAP = 512  # per boundary; far above what chains of a few hundred blocks produce

# the placements the DP may use, plain ones first (equal cost: the plain one wins)
PLACEMENTS: dict[str, tuple[str, ...]] = {
    "none": ("stored", "checkpoint"),
    "inputs": ("stored", "checkpoint_offload"),
    "auto": ("stored", "checkpoint", "stored_offload", "checkpoint_offload"),
    # a stored_offload with nothing big enough to move stays a plain stored block
    "all": ("stored_offload", "checkpoint_offload"),
}


class Tables:
    """Every candidate segment of a profile and its cost, by first block.

    Args:
        prof: The profile.
        offload: ``"none"``, ``"inputs"`` (checkpointed inputs on the next tier), ``"all"``
            or ``"auto"`` (every placement).
        tier: The next tier (its bandwidth, ``min_bytes``); without it nothing offloads.
        allow_selective: Also one-block selective checkpoints.
    """

    def __init__(self, prof: Profile, offload: OffloadMode = "none",
                 tier: OffloadTier | None = None,
                 allow_selective: bool = False) -> None:
        self.prof, self.tier = prof, tier
        n = self.n = len(prof.blocks)
        offloading = tier is not None and offload != "none"
        kinds = PLACEMENTS[offload] if offloading else PLACEMENTS["none"]
        min_bytes = tier.min_bytes if tier is not None else 1 << 62
        self.starting: list[list[tuple[int, Segment, SegmentCost]]] = [[] for _ in range(n)]
        for a in range(n):
            for kind in kinds:
                # Stored placements are searched one block at a time (runs of stored blocks
                # are joined afterwards where that changes nothing): longer stored or
                # stored_offload segments would only lengthen the window an offloaded
                # segment's bytes stay for, and make the fronts much larger.
                last = a + 1 if kind.startswith("stored") else n
                for b in range(a + 1, last + 1):
                    c = segment_cost(prof, a, b, kind, min_bytes)  # type: ignore[arg-type]
                    placed = kind
                    if kind.endswith("_offload") and not c.offload_bytes:
                        # nothing big enough to move: the plain kind, unless that is a choice
                        placed = kind.removesuffix("_offload")
                        if placed in kinds:
                            continue
                    self.starting[a].append((b, Segment(a, b, placed), c))  # type: ignore[arg-type]
            if allow_selective:
                self.starting[a].append((a + 1, Segment(a, a + 1, "selective"),
                                         segment_cost(prof, a, a + 1, "selective")))
        self.tail = tail_cost(prof)
        # Per boundary: the highest peak constant still ahead, and how far the savings net of
        # the bytes still held can fall on the way (segments that drop less than the input
        # they keep): bounds for clamping savings in _search.
        self._peaks = [max([c.peak_const for row in self.starting[j:] for _, _, c in row]
                           + [self.tail.peak_const]) for j in range(n + 1)]
        # the most host bytes any plan can take (a host budget at or above it cannot bind)
        self.most_host = sum(max([0] + [c.host_bytes for b, _, c in row if b == a + 1])
                             for a, row in enumerate(self.starting)) + sum(
            max([0] + [c.host_bytes for b, seg, c in row if seg.kind == "checkpoint_offload"])
            for row in self.starting)
        drops = [max([0] + [c.offload_bytes - c.savings for _, _, c in row])
                 for row in self.starting]
        self._drops = [sum(drops[j:]) for j in range(n + 1)]

    def enough(self, j: int, budget: int, held: int) -> int:
        """Savings at boundary ``j`` past which nothing later (the tail included) needs more
        to fit ``budget``, for an entry whose last segment left ``held`` bytes: savings above
        it are clamped to it — exact, and it keeps the fronts small when the budget is loose."""
        return max(self._peaks[j] - budget, 0) + held + self._drops[j]

    def move(self, offloaded: SegmentCost | None, following: SegmentCost) -> float:
        if offloaded is None or self.tier is None:
            return 0.0
        return move_seconds(offloaded, following, self.tier)


class _Entry:
    """A feasible plan of the chain's first blocks, on a DP front."""

    __slots__ = ("time", "savings", "held", "host", "peak", "last", "parent", "segment", "framed")

    def __init__(self, time: float, savings: int, held: int, host: int, peak: int,
                 last: SegmentCost | None, parent: _Entry | None, segment: Segment | None,
                 framed: bool = False) -> None:
        self.time = time  # recompute + moves charged so far
        self.savings = savings
        self.held = held  # bytes the last segment offloaded (on the device during the next)
        self.host = host
        self.peak = peak
        self.last = last  # the last segment's cost, when it offloaded (its move is due)
        self.parent, self.segment = parent, segment
        self.framed = framed  # a checkpoint frame came: savings are net of frame_bytes


def _search(tables: Tables, budget: int | None, offload_host_budget: int | None,
            by: Literal["time", "peak"]) -> list[tuple[_Entry, int, float]]:
    """Complete plans on the fronts: ``(entry, peak, time)`` with the tail charged."""
    prof, n = tables.prof, tables.n
    fronts: list[list[_Entry]] = [[] for _ in range(n + 1)]
    if budget is None or prof.prefix_peak_bytes <= budget:
        fronts[0] = [_Entry(0.0, 0, 0, 0, prof.prefix_peak_bytes, None, None, None)]
    host_counts = offload_host_budget is not None and offload_host_budget < tables.most_host
    frame = prof.frame_bytes
    limit = budget if budget is not None else 1 << 62
    host_limit = offload_host_budget if offload_host_budget is not None else 1 << 62
    for j in range(n):
        front = fronts[j]
        if budget is not None:
            for e in front:  # clamp in place: e's successors are not made yet
                e.savings = min(e.savings, tables.enough(j, budget, e.held)
                                + (0 if e.framed else frame))
        fronts[j] = front = _prune(front, by, host_counts, frame)
        for e in front:
            for k, seg, c in tables.starting[j]:
                first = c.frame and not e.framed
                savings = e.savings - frame if first else e.savings
                peak = c.peak_const - (savings - e.held)
                host = e.host + c.host_bytes
                if peak > limit or host > host_limit:
                    continue
                time = e.time + c.recompute_s
                if e.last is not None:
                    time += tables.move(e.last, c)
                fronts[k].append(_Entry(time, savings + c.savings, c.offload_bytes, host,
                                        peak if peak > e.peak else e.peak,
                                        c if c.offload_bytes else None, e, seg,
                                        e.framed or c.frame))
    out = []
    for e in fronts[n]:
        peak = max(e.peak, tables.tail.peak_const - (e.savings - e.held))
        if peak <= limit:
            out.append((e, peak, e.time + tables.move(e.last, tables.tail)))
    return out


def _prune(front: list[_Entry], by: str, host_counts: bool, frame: int = 0) -> list[_Entry]:
    """Keep the Pareto front: drop entries another beats or equals on every count.

    Host bytes count only when the host budget can bind (``host_counts``); otherwise they
    only order equal entries (the one with fewer is kept). An entry no frame came to yet
    still owes ``frame`` bytes of savings to the first one that comes: it beats a framed
    entry only with that much savings to spare.
    """
    first = (lambda e: e.time) if by == "time" else (lambda e: e.peak)
    front.sort(key=lambda e: (first(e), -e.savings, e.held, e.host))
    out: list[_Entry] = []

    def beats(o: _Entry, e: _Entry) -> bool:  # o's savings are enough for e's every future
        return o.savings - (frame if e.framed and not o.framed else 0) >= e.savings

    if host_counts:
        for e in front:
            if not any(beats(o, e) and o.held <= e.held and o.host <= e.host for o in out):
                out.append(e)
    else:
        # most savings kept so far per (bytes held, framed) (few distinct values: block
        # sizes); an entry is beaten by one with no more held and savings enough
        best: dict[tuple[int, bool], int] = {}
        for e in front:
            if not any(s - (frame if e.framed and not f else 0) >= e.savings
                       for (h, f), s in best.items() if h <= e.held):
                out.append(e)
                key = (e.held, e.framed)
                best[key] = max(best.get(key, e.savings), e.savings)
    if len(out) > _FRONT_CAP:  # thin evenly, keeping both ends
        step = len(out) / _FRONT_CAP
        out = [out[int(i * step)] for i in range(_FRONT_CAP - 1)] + [out[-1]]
    return out


def _segments_of(entry: _Entry) -> tuple[Segment, ...]:
    segs: list[Segment] = []
    e: _Entry | None = entry
    while e is not None and e.segment is not None:
        segs.append(e.segment)
        e = e.parent
    return _merge_stored(segs[::-1])


def _merge_stored(segs: list[Segment]) -> tuple[Segment, ...]:
    """Join neighbouring stored segments — unless an offloaded segment comes right before:
    its bytes are on the device through the whole next segment, so the cut changes the plan."""
    out: list[Segment] = []
    for s in segs:
        if (out and s.kind == "stored" and out[-1].kind == "stored"
                and not (len(out) > 1 and out[-2].offloads)):
            out[-1] = Segment(out[-1].start, s.stop, "stored")
        else:
            out.append(s)
    return tuple(out)


def smallest_peak(prof: Profile, tables: Tables | None = None, *, offload: OffloadMode = "none",
                  tier: OffloadTier | None = None, offload_host_budget: int | None = None,
                  ) -> tuple[int, int, tuple[Segment, ...]]:
    """The smallest predicted peak any plan reaches, the host bytes it needs, its segments."""
    tables = tables or Tables(prof, offload, tier)
    done = _search(tables, None, offload_host_budget, "peak")
    e, peak, _ = min(done, key=lambda d: (d[1], d[0].host))
    return int(peak), e.host, _segments_of(e)


def min_peak(prof: Profile, tables: Tables | None = None, offload: OffloadMode = "none",
             tier: OffloadTier | None = None, offload_host_budget: int | None = None) -> int:
    """The smallest predicted peak any plan reaches (stored/checkpointed segments unless
    ``offload`` and a ``tier`` allow offloaded ones)."""
    return smallest_peak(prof, tables, offload=offload, tier=tier,
                         offload_host_budget=offload_host_budget)[0]


def solve_budget(prof: Profile, budget: int, tables: Tables | None = None,
                 offload: OffloadMode = "none", allow_selective: bool = False, *,
                 tier: OffloadTier | None = None, offload_host_budget: int | None = None,
                 ) -> tuple[Segment, ...]:
    """Segments with the least modelled time whose predicted peak is ≤ ``budget``.

    Time is recompute plus the moves not hidden behind compute; equal times go to the plan
    with fewer host bytes (so a plan offloads only when that pays off or is needed).

    Raises:
        ValueError: No plan fits; the message gives the smallest peak a plan reaches and the
            host bytes it would need.
    """
    tables = tables or Tables(prof, offload, tier, allow_selective)
    done = _search(tables, budget, offload_host_budget, "time")
    if not done:
        raise ValueError(_no_plan_message(prof, budget, tables, offload, tier, offload_host_budget))
    best = min(done, key=lambda d: (d[2], d[0].host, -d[0].savings))
    return _segments_of(best[0])


def _no_plan_message(prof: Profile, budget: int, tables: Tables, offload: OffloadMode,
                     tier: OffloadTier | None, offload_host_budget: int | None) -> str:
    need, host, _ = smallest_peak(prof, tables, offload_host_budget=offload_host_budget)
    where = f"{tier.name} tier" if tier is not None else "next tier"
    msg = (f"budget {budget / _MIB:.1f} MiB ({budget} bytes) is below the smallest peak any "
           f"checkpoint plan reaches on this example, {need / _MIB:.1f} MiB ({need} bytes)")
    if host or (offload != "none" and tier is not None):
        # the host bytes are named even when 0: "how much host memory would it need" is asked
        msg += f", with {host} bytes ({host / _MIB:.1f} MiB) offloaded to the {where}"
    if offload_host_budget is not None and tier is not None and offload != "none":
        free, free_host, _ = smallest_peak(prof, Tables(prof, offload, tier))
        if free < need:
            msg += (f"; without the host budget ({offload_host_budget} bytes) it would be "
                    f"{free} bytes "
                    f"with {free_host} bytes on the {where}")
    return (msg + f". Raise the budget to at least {need}, or shrink the batch / sequence, or "
            "compute the head + loss in chunks (tightfit.loss)"
            + ("" if offload == "auto" else ", or let offload='auto' move activations to the "
               "next tier") + ".")


def make_plan(prof: Profile, policy: str, *, budget: int | None = None,
              offload: OffloadMode = "none",
              tier: OffloadTier | None = None, notes: tuple[str, ...] = ()) -> Plan:
    """Build the plan of ``policy`` for a profiled model, with its predictions.

    ``offload``: ``"none"`` never offloads; ``"inputs"`` puts every checkpointed segment's input on
    the next tier; ``"all"`` also stored blocks' saved tensors; ``"auto"`` lets the budget
    solver use every placement. Offloading needs a ``tier`` (its ``offload_host_budget`` bounds the
    host bytes).
    """
    name, k = parse_policy(policy)
    offload_host_budget = tier.offload_host_budget if tier is not None else None
    if name == "budget":
        if budget is None:
            raise ValueError("policy='budget' needs budget=<bytes>.")
        segments = solve_budget(prof, budget, offload=offload, tier=tier,
                                offload_host_budget=offload_host_budget)
    else:
        segments = structural_segments(name, k, len(prof.blocks))
        segments = apply_offload(segments, offload)
    return _plan_of(prof, segments, budget if name == "budget" else None, policy=policy,
                    tier=tier, notes=notes)


def frontier(prof: Profile, points: int = 24) -> list[Plan]:
    """The memory/recompute frontier: plans where less memory always costs more recompute."""
    tables = Tables(prof)
    n = len(prof.blocks)
    lo = min_peak(prof, tables)
    hi = predict(prof, structural_segments("none", None, n)).peak_bytes
    budgets = {lo, hi}
    if lo > 0:
        budgets |= {int(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)}
    plans: dict[tuple, Plan] = {}
    for b in sorted(budgets):
        segs = solve_budget(prof, max(b, lo), tables)
        if segs not in plans:
            plans[segs] = _plan_of(prof, segs, max(b, lo))
    out: list[Plan] = []
    for p in sorted(plans.values(),
                    key=lambda p: (p.predicted_peak_bytes, p.predicted_recompute_fraction)):
        if not out or p.predicted_recompute_fraction < out[-1].predicted_recompute_fraction:
            out.append(p)
    return out


def _plan_of(prof: Profile, segments: tuple[Segment, ...], budget: int | None, *,
             policy: str = "budget", tier: OffloadTier | None = None,
             notes: tuple[str, ...] = ()) -> Plan:
    """The plan of ``segments``, with what :func:`predict` gives."""
    offloads = any(s.offloads for s in segments)
    pred = predict(prof, segments, tier if offloads else None)
    step = prof.step_s
    return Plan(policy, segments, predicted_peak_bytes=pred.peak_bytes,
                predicted_recompute_fraction=pred.recompute_s / step if step else 0.0,
                budget_bytes=budget, notes=notes, profile=prof,
                tier=tier if offloads else None, host_bytes=pred.host_bytes,
                predicted_move_fraction=(pred.move_s / step if step else 0.0) if offloads
                else None)

