"""Plans: a chain of blocks cut into segments that are stored or checkpointed.

Every policy ("none", "every", "sqrt", "uniform:k", "budget", "selective") is a :class:`Plan`
of the same model, so their predicted peaks and recompute costs compare on equal terms
(see :mod:`tightfit.checkpoint.cost` for the peak model and :mod:`.solver` for "budget").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tightfit.checkpoint.chain import Profile

SegmentKind = Literal["stored", "checkpoint", "selective"]
PolicyName = Literal["none", "every", "sqrt", "uniform", "budget", "selective"]
POLICIES = ("none", "every", "sqrt", "uniform:k", "budget", "selective")


@dataclass(frozen=True)
class Segment:
    """Blocks ``start`` .. ``stop - 1`` of the chain, run as one unit.

    ``stored`` keeps every activation (no recompute); ``checkpoint`` keeps only the
    segment's input and recomputes the segment in backward; ``selective`` is a one-block
    checkpoint that keeps matmul/attention outputs and recomputes the cheap ops.
    """

    start: int
    stop: int
    kind: SegmentKind

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """Where a model is checkpointed, with its predicted cost.

    Attributes:
        policy: The policy that produced the plan, e.g. ``"budget"`` or ``"uniform:4"``.
        segments: The chain's segments in forward order (they cover every block once).
        predicted_peak_bytes: Predicted peak bytes a training step (forward + backward)
            allocates on top of what exists before it; ``None`` without a profile.
        predicted_recompute_fraction: Predicted recompute time ÷ profiled step time
            (so step time ≈ 1 + this × no-checkpoint step time); ``None`` without a profile.
        budget_bytes: The budget a ``"budget"`` plan was solved for.
        offload: Checkpointed segment inputs wait on the host (CUDA only).
        notes: Things the caller should know (e.g. offload being a no-op on the CPU).
        profile: The measurements behind the prediction.
    """

    policy: str
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int | None = None
    predicted_recompute_fraction: float | None = None
    budget_bytes: int | None = None
    offload: bool = False
    notes: tuple[str, ...] = ()
    profile: Profile | None = field(default=None, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    @property
    def checkpointed_blocks(self) -> int:
        return sum(len(s) for s in self.segments if s.kind != "stored")

    def __str__(self) -> str:
        mib = 1024 * 1024
        lines = [f"checkpoint plan: policy={self.policy}, {self.num_blocks} blocks, "
                 f"{sum(s.kind != 'stored' for s in self.segments)} checkpointed segments"]
        if self.budget_bytes is not None:
            lines.append(f"  budget               {self.budget_bytes / mib:10.1f} MiB")
        if self.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak       {self.predicted_peak_bytes / mib:10.1f} MiB")
        if self.predicted_recompute_fraction is not None:
            lines.append(f"  predicted recompute  {100 * self.predicted_recompute_fraction:9.1f} % "
                         "of a step")
        prof = self.profile
        header = f"  {'blocks':>9}  {'kind':<10}"
        if prof is not None:
            header += f"  {'input MiB':>9}  {'saved MiB':>9}  {'fwd ms':>8}"
        lines.append(header)
        for s in self.segments:
            row = f"  {s.start:>4}-{s.stop - 1:<4}  {s.kind:<10}"
            if prof is not None:
                saved = sum(prof.blocks[i].saved_bytes for i in range(s.start, s.stop))
                ms = 1e3 * sum(prof.blocks[i].forward_s for i in range(s.start, s.stop))
                row += (f"  {prof.blocks[s.start].input_bytes / mib:9.2f}  {saved / mib:9.2f}"
                        f"  {ms:8.2f}")
            lines.append(row)
        if prof is not None:
            lines.append(f"  {'tail':>9}  {'stored':<10}  {'':>9}  "
                         f"{prof.tail_saved_bytes / mib:9.2f}  {1e3 * prof.tail_forward_s:8.2f}"
                         "   (head + loss after the chain)")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def parse_policy(policy: str) -> tuple[PolicyName, int | None]:
    """Split ``"uniform:4"`` into ``("uniform", 4)``; validate every other name.

    Raises:
        ValueError: Unknown policy, or a malformed ``uniform:k``.
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string, one of {POLICIES}; got {type(policy).__name__}.")
    if policy.startswith("uniform"):
        _, _, k = policy.partition(":")
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"policy {policy!r}: write 'uniform:k' with k ≥ 1 segments, "
                             "e.g. 'uniform:4'.")
        return "uniform", int(k)
    if policy in ("none", "every", "sqrt", "budget", "selective"):
        return policy, None  # type: ignore[return-value]
    raise ValueError(f"unknown checkpoint policy {policy!r}; choose one of {', '.join(POLICIES)}.")


def uniform_segments(n: int, k: int, kind: SegmentKind = "checkpoint") -> tuple[Segment, ...]:
    """``k`` checkpointed segments of near-equal length (lengths differ by at most one)."""
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return tuple(Segment(a, b, kind) for a, b in zip(bounds[:-1], bounds[1:]) if b > a)


def structural_segments(name: PolicyName, k: int | None, n: int) -> tuple[Segment, ...]:
    """Segments of every policy that does not need a profile (all but ``budget``)."""
    if name == "none":
        return (Segment(0, n, "stored"),)
    if name == "every":
        return uniform_segments(n, n)
    if name == "selective":
        return uniform_segments(n, n, "selective")
    if name == "sqrt":
        # Chen et al. 2016: ≈√n segments of ≈√n blocks keeps √n inputs + one segment's
        # activations, i.e. O(√n) memory for one extra forward.
        return uniform_segments(n, max(1, round(math.sqrt(n))))
    if name == "uniform":
        assert k is not None
        return uniform_segments(n, k)
    raise ValueError(f"policy {name!r} needs a profile; use the solver.")
