"""The budget solver: least recompute whose predicted peak fits, exactly, by DP.

Segments it chooses from: stored blocks and checkpointed runs of consecutive blocks; with
``allow_selective=True`` also one-block selective checkpoints. That is off by default: the
selective peak prediction is the least exact one (measured 1–3 % off either way, torch's
selective cache keeps a little the profile does not see), and a budget plan must fit.

With the peak model of :mod:`tightfit.checkpoint.cost`, a segment's feasibility depends only
on the savings ``S`` of the segments before it (more is always better), and the recompute
cost adds up. So a DP over block boundaries that keeps, per boundary, the Pareto front of
(recompute, savings) over feasible prefixes finds the optimum: O(n²) segment constants, then
transitions per front entry. The smallest feasible budget is found by bisection on a
savings-only DP.
"""

from __future__ import annotations

import math

from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.cost import SegmentCost, predict, segment_cost
from tightfit.checkpoint.plan import Plan, Segment, parse_policy, structural_segments

_MIB = 1024 * 1024
_FRONT_CAP = 512  # per boundary; far above what chains of a few hundred blocks produce


def _tables(prof: Profile, offload: bool = False, allow_selective: bool = False) -> tuple:
    """Per-block stored and selective costs; checkpoint costs of every segment ``(a, b)``."""
    n = len(prof.blocks)
    stored = [segment_cost(prof, i, i + 1, "stored") for i in range(n)]
    selective = [segment_cost(prof, i, i + 1, "selective", offload) if allow_selective
                 else SegmentCost(2**62, 0, 0.0) for i in range(n)]  # never feasible
    ckpt = {(a, b): segment_cost(prof, a, b, "checkpoint", offload)
            for a in range(n) for b in range(a + 1, n + 1)}
    return stored, selective, ckpt


def _max_savings(prof: Profile, budget: int, tables: tuple) -> float:
    """Most savings any plan that fits ``budget`` reaches at the end of the chain."""
    stored, selective, ckpt = tables
    n = len(prof.blocks)
    best = [-math.inf] * (n + 1)
    best[0] = 0 if prof.prefix_peak_bytes <= budget else -math.inf
    for j in range(n):
        s = best[j]
        if s == -math.inf:
            continue
        if stored[j].peak_const - s <= budget:
            best[j + 1] = max(best[j + 1], s)
        if selective[j].peak_const - s <= budget:
            best[j + 1] = max(best[j + 1], s + selective[j].savings)
        for k in range(j + 1, n + 1):
            c = ckpt[(j, k)]
            if c.peak_const - s <= budget:
                best[k] = max(best[k], s + c.savings)
    return best[n]


def min_peak(prof: Profile, tables: tuple | None = None, offload: bool = False) -> int:
    """The smallest predicted peak any plan reaches (stored/checkpointed segments)."""
    tables = tables or _tables(prof, offload)
    lo, hi = 0, max(predict(prof, structural_segments("none", None, len(prof.blocks)))[0], 1)

    def fits(b: int) -> bool:
        return _max_savings(prof, b, tables) >= prof.tail_peak_bytes - b

    while not fits(hi):  # cannot happen with a consistent profile; be safe
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def solve_budget(prof: Profile, budget: int, tables: tuple | None = None,
                 offload: bool = False, allow_selective: bool = False) -> tuple[Segment, ...]:
    """Segments with the least predicted recompute whose predicted peak is ≤ ``budget``.

    Raises:
        ValueError: No plan fits; the message gives the smallest budget that does.
    """
    tables = tables or _tables(prof, offload, allow_selective)
    stored, selective, ckpt = tables
    n = len(prof.blocks)
    # front entries: (recompute_s, savings, parent entry, segment)
    fronts: list[list[tuple]] = [[] for _ in range(n + 1)]
    if prof.prefix_peak_bytes <= budget:
        fronts[0] = [(0.0, 0, None, None)]
    for j in range(n):
        fronts[j] = _prune(fronts[j])
        for entry in fronts[j]:
            cost, s = entry[0], entry[1]
            if stored[j].peak_const - s <= budget:
                fronts[j + 1].append((cost, s, entry, Segment(j, j + 1, "stored")))
            c = selective[j]
            if c.peak_const - s <= budget:
                fronts[j + 1].append((cost + c.recompute_s, s + c.savings, entry,
                                      Segment(j, j + 1, "selective")))
            for k in range(j + 1, n + 1):
                c = ckpt[(j, k)]
                if c.peak_const - s <= budget:
                    fronts[k].append((cost + c.recompute_s, s + c.savings, entry,
                                      Segment(j, k, "checkpoint")))
    final = [e for e in fronts[n] if e[1] >= prof.tail_peak_bytes - budget]
    if not final:
        need = min_peak(prof, tables)
        raise ValueError(
            f"budget {budget / _MIB:.1f} MiB ({budget} bytes) is below the smallest peak any "
            f"checkpoint plan reaches on this example, {need / _MIB:.1f} MiB ({need} bytes). "
            f"Raise the budget to at least {need}, or shrink the batch / sequence, or compute "
            "the head + loss in chunks (tightfit.loss)."
        )
    best = min(final, key=lambda e: (e[0], -e[1]))
    segs: list[Segment] = []
    while best[3] is not None:
        segs.append(best[3])
        best = best[2]
    return _merge_stored(segs[::-1])


def _prune(front: list[tuple]) -> list[tuple]:
    """Keep the Pareto front: no entry with more recompute and no more savings."""
    front.sort(key=lambda e: (e[0], -e[1]))
    out: list[tuple] = []
    for e in front:
        if not out or e[1] > out[-1][1]:
            out.append(e)
    if len(out) > _FRONT_CAP:  # thin evenly, keeping both ends
        step = len(out) / _FRONT_CAP
        out = [out[int(i * step)] for i in range(_FRONT_CAP - 1)] + [out[-1]]
    return out


def _merge_stored(segs: list[Segment]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for s in segs:
        if out and s.kind == "stored" and out[-1].kind == "stored":
            out[-1] = Segment(out[-1].start, s.stop, "stored")
        else:
            out.append(s)
    return tuple(out)


def make_plan(prof: Profile, policy: str, *, budget: int | None = None, offload: bool = False,
              notes: tuple[str, ...] = ()) -> Plan:
    """Build the plan of ``policy`` for a profiled model, with its predictions."""
    name, k = parse_policy(policy)
    if name == "budget":
        if budget is None:
            raise ValueError("policy='budget' needs budget=<bytes>.")
        segments = solve_budget(prof, budget, offload=offload)
    else:
        segments = structural_segments(name, k, len(prof.blocks))
    return _plan_of(prof, segments, budget if name == "budget" else None, policy=policy,
                    offload=offload, notes=notes)


def frontier(prof: Profile, points: int = 24) -> list[Plan]:
    """The memory/recompute frontier: plans where less memory always costs more recompute."""
    tables = _tables(prof)
    n = len(prof.blocks)
    lo = min_peak(prof, tables)
    hi = predict(prof, structural_segments("none", None, n))[0]
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
             policy: str = "budget", offload: bool = False, notes: tuple[str, ...] = ()) -> Plan:
    """The plan of ``segments``, with the peak and recompute :func:`predict` gives."""
    peak, recompute = predict(prof, segments, offload)
    return Plan(policy, segments, predicted_peak_bytes=int(peak),
                predicted_recompute_fraction=recompute / prof.step_s if prof.step_s else 0.0,
                budget_bytes=budget, offload=offload, notes=notes, profile=prof)
