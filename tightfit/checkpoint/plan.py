"""Plans: a chain of blocks cut into segments, each with a placement for its activations.

Every policy ("none", "every", "sqrt", "uniform:k", "budget", "selective") is a :class:`Plan`
of the same model, so their predicted peaks and recompute costs compare on equal terms
(see :mod:`tightfit.checkpoint.cost` for the peak model and :mod:`.solver` for "budget").
A segment's activations stay on the device, go to the next tier (:class:`OffloadTier`) until
their backward, are recomputed, or are recomputed from an input kept on the next tier.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Literal

from tightfit.checkpoint.chain import Profile

SegmentKind = Literal["stored", "stored_offload", "checkpoint", "checkpoint_offload",
                      "selective"]
KINDS: tuple[str, ...] = ("stored", "stored_offload", "checkpoint", "checkpoint_offload",
                          "selective")
PolicyName = Literal["none", "every", "sqrt", "uniform", "budget", "selective"]
POLICIES = ("none", "every", "sqrt", "uniform:k", "budget", "selective")
MIN_OFFLOAD_BYTES = 1 << 20
"""Saved storages smaller than this stay on the device: moving them costs more than it frees."""
# Where activations may wait for backward: one vocabulary for checkpoint.enable, prepare(),
# the planner's TrainSetup (which names a configuration, so has no "auto") and tightfit train.
OffloadMode = Literal["auto", "none", "inputs", "all"]
OFFLOADS: tuple[str, ...] = ("auto", "none", "inputs", "all")


@dataclass(frozen=True)
class Segment:
    """Blocks ``start`` .. ``stop - 1`` of the chain, run as one unit.

    ``stored`` keeps every activation on the device (no recompute); ``stored_offload`` moves
    the activations it saves to the next tier after its forward and back before its
    backward; ``checkpoint`` keeps only the segment's input and recomputes the segment in
    backward; ``checkpoint_offload`` does the same with the input on the next tier;
    ``selective`` is a one-block checkpoint that keeps matmul/attention outputs and
    recomputes the cheap ops.
    """

    start: int
    stop: int
    kind: SegmentKind

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def recomputes(self) -> bool:
        """The segment is recomputed in backward (a checkpoint frame)."""
        return self.kind in ("checkpoint", "checkpoint_offload", "selective")

    @property
    def offloads(self) -> bool:
        """Bytes of the segment wait on the next tier until its backward."""
        return self.kind in ("stored_offload", "checkpoint_offload")


@dataclass(frozen=True)
class OffloadTier:
    """Where a plan's offloaded bytes go, and what moving them costs.

    Attributes:
        name: ``"disk"`` (a spill file: the next tier when the device is the CPU) or
            ``"host"`` (pinned host RAM: the next tier of a CUDA device).
        bandwidth: Bytes per second of a move one way, out or back (measured once per
            device and tier, or given; 0: not measured).
        overlap: Whether moves run beside the compute (CUDA's copy engines); on the CPU the
            copy thread shares the cores with the compute, so moves are charged whole.
        min_bytes: Saved storages smaller than this stay on the device.
        offload_host_budget: Bytes the plan may place on the tier (``None``: no limit).
        offload_dir: The folder of the disk tier's spill files (``None``: the temp folder).
        latency_s: Fixed seconds of one move of a segment's bytes, one way (on the disk tier
            mostly the ``msync``).
    """

    name: str
    bandwidth: float
    overlap: bool
    min_bytes: int = MIN_OFFLOAD_BYTES
    offload_host_budget: int | None = None
    offload_dir: str | None = None
    latency_s: float = 0.0


def offload_sizes(prof: Profile, seg: Segment, min_bytes: int) -> list[int]:
    """Bytes of each storage ``seg`` places on the next tier (``[]`` if it offloads none).

    ``stored_offload``: what its blocks save for backward (parameters and the tensors a
    block is passed besides its first argument excluded: they stay alive elsewhere);
    ``checkpoint_offload``: the segment's input, which the checkpoint frame saves. The
    chain's own input stays: the model's forward holds it (HF's ``inputs_embeds``), so moving
    it would free nothing.
    """
    if seg.kind == "checkpoint_offload":
        x = prof.blocks[seg.start].input_bytes
        return [x] if x >= min_bytes and seg.start > 0 else []
    if seg.kind != "stored_offload":
        return []
    out: list[int] = []
    for b in prof.blocks[seg.start:seg.stop]:
        sizes = b.saved_sizes if b.saved_sizes is not None else (b.saved_bytes,)
        out += [n for n in sizes if n >= min_bytes]
    return out


@dataclass(frozen=True)
class Plan:
    """Where a model is checkpointed, with its predicted cost.

    Attributes:
        policy: The policy that produced the plan, e.g. ``"budget"`` or ``"uniform:4"``.
        segments: The chain's segments in forward order (they cover every block once).
        predicted_peak_bytes: Predicted peak bytes a training step (forward + backward)
            allocates on the device on top of what exists before it; ``None`` without a
            profile.
        predicted_recompute_fraction: Predicted recompute time ÷ profiled step time
            (so step time ≈ 1 + this × no-checkpoint step time); ``None`` without a profile.
        budget_bytes: The budget a ``"budget"`` plan was solved for.
        notes: Things the caller should know.
        profile: The measurements behind the prediction.
        tier: Where offloaded segments put their bytes (``None`` when none offloads).
        host_bytes: Predicted bytes the offloaded segments take on that tier at once (page
            rounded): what the host (or the spill folder's disk) must hold.
        predicted_move_fraction: Predicted time of the moves not hidden behind compute ÷
            profiled step time; ``None`` without a profile.
    """

    policy: str
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int | None = None
    predicted_recompute_fraction: float | None = None
    budget_bytes: int | None = None
    notes: tuple[str, ...] = ()
    profile: Profile | None = field(default=None, repr=False, compare=False)
    tier: OffloadTier | None = None
    host_bytes: int = 0
    predicted_move_fraction: float | None = None

    @property
    def num_blocks(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    @property
    def checkpointed_blocks(self) -> int:
        """Blocks recomputed in backward."""
        return sum(len(s) for s in self.segments if s.recomputes)

    @property
    def offload(self) -> bool:
        """Whether any segment places bytes on the next tier."""
        return any(s.offloads for s in self.segments)

    def __str__(self) -> str:
        mib = 1024 * 1024
        lines = [f"checkpoint plan: policy={self.policy}, {self.num_blocks} blocks, "
                 f"{sum(s.recomputes for s in self.segments)} checkpointed segments, "
                 f"{sum(s.offloads for s in self.segments)} offloaded"]
        if self.budget_bytes is not None:
            lines.append(f"  budget               {self.budget_bytes / mib:10.1f} MiB")
        if self.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak       {self.predicted_peak_bytes / mib:10.1f} MiB")
        if self.predicted_recompute_fraction is not None:
            lines.append(f"  predicted recompute  {100 * self.predicted_recompute_fraction:9.1f} % "
                         "of a step")
        lines.extend(self._tier_lines())
        lines.extend(self._segment_lines())
        lines.extend(textwrap.fill(f"note: {n}", 100, initial_indent="  ",
                                   subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False) for n in self.notes)
        return "\n".join(lines)

    def _tier_lines(self) -> list[str]:
        if self.tier is None or not self.offload:
            return []
        mib, t = 1024 * 1024, self.tier
        allowed = ("" if t.offload_host_budget is None
                   else f" of {t.offload_host_budget / mib:.1f} MiB allowed")
        lines = [f"  next tier ({t.name:<4})     {self.host_bytes / mib:10.1f} MiB{allowed}; "
                 f"{t.bandwidth / 1e9:.2f} GB/s + {1e3 * t.latency_s:.2f} ms a move",
                 f"  {'':<19}  moves {'' if t.overlap else 'not '}overlapped with compute"]
        if self.predicted_move_fraction is not None:
            lines.append(f"  predicted moves      {100 * self.predicted_move_fraction:9.1f} % "
                         "of a step (not hidden behind compute)")
        return lines

    def _segment_lines(self) -> list[str]:
        mib, prof = 1024 * 1024, self.profile
        min_bytes = self.tier.min_bytes if self.tier is not None else MIN_OFFLOAD_BYTES
        header = f"  {'blocks':>9}  {'kind':<18}"
        if prof is not None:
            header += f"  {'input MiB':>9}  {'saved MiB':>9}  {'moved MiB':>9}  {'fwd ms':>8}"
        lines = [header]
        for s in self.segments:
            row = f"  {s.start:>4}-{s.stop - 1:<4}  {s.kind:<18}"
            if prof is not None:
                saved = sum(prof.blocks[i].saved_bytes for i in range(s.start, s.stop))
                moved = sum(offload_sizes(prof, s, min_bytes))
                ms = 1e3 * sum(prof.blocks[i].forward_s for i in range(s.start, s.stop))
                row += (f"  {prof.blocks[s.start].input_bytes / mib:9.2f}  {saved / mib:9.2f}"
                        f"  {moved / mib:9.2f}  {ms:8.2f}")
            lines.append(row)
        if prof is not None:
            lines.append(f"  {'head+loss':>9}  {'stored':<18}  {'':>9}  "
                         f"{prof.tail_saved_bytes / mib:9.2f}  {0:9.2f}  "
                         f"{1e3 * prof.tail_forward_s:8.2f}")
        return lines


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


def apply_offload(segments: tuple[Segment, ...], mode: OffloadMode) -> tuple[Segment, ...]:
    """``segments`` with a fixed offload ``mode`` applied: ``"inputs"`` :func:`offload_inputs`,
    ``"all"`` :func:`offload_all`; ``"none"`` and ``"auto"`` (the budget solver's choice)
    leave them as they are."""
    if mode == "inputs":
        return offload_inputs(segments)
    if mode == "all":
        return offload_all(segments)
    return segments


def offload_inputs(segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """``offload="inputs"``: every checkpointed segment's input waits on the next tier."""
    return tuple(Segment(s.start, s.stop, "checkpoint_offload") if s.kind == "checkpoint" else s
                 for s in segments)


def offload_all(segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """``offload="all"``: checkpointed inputs on the next tier, and every stored block's saved
    tensors too, one block a segment (a segment moves and is prefetched whole, so one block
    each keeps one block's bytes in flight; the planner applies it too, :func:`apply_offload`)."""
    out: list[Segment] = []
    for s in offload_inputs(segments):
        if s.kind == "stored":
            out += [Segment(i, i + 1, "stored_offload") for i in range(s.start, s.stop)]
        else:
            out.append(s)
    return tuple(out)
