"""Helpers for the offload tests: install a plan of chosen placements, measure a step."""

from __future__ import annotations

import os

import torch
from torch import nn

from tightfit.checkpoint import apply
from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.offload import Offloader
from tightfit.checkpoint.plan import OffloadTier, Plan, Segment
from tightfit.checkpoint.profile import step_loss
from tightfit.checkpoint.solver import _plan_of
from tightfit.measure.tracker import MemoryTracker
from tightfit.model.blocks import resolve_blocks

MIN_BYTES = 16 << 10  # the tiny models' saved tensors are KiBs: move those above 16 KiB


def disk_tier(bandwidth: float = 1e9, **kwargs: object) -> OffloadTier:
    return OffloadTier("disk", bandwidth, False, MIN_BYTES, **kwargs)  # type: ignore[arg-type]


def install(model: nn.Module, prof: Profile, kinds: list[str] | str,
            tier: OffloadTier | None = None) -> Plan:
    """Install one segment per block with placements ``kinds`` (cycled), predicted from
    ``prof``; returns the plan."""
    n = len(prof.blocks)
    kinds = [kinds] if isinstance(kinds, str) else kinds
    segments = tuple(Segment(i, i + 1, kinds[i % len(kinds)]) for i in range(n))  # type: ignore[arg-type]
    plan = _plan_of(prof, segments, None, policy="test", tier=tier or disk_tier())
    apply.uninstall(model)
    apply.install(model, resolve_blocks(model, None), plan)
    return plan


def offloader(model: nn.Module) -> Offloader:
    off = getattr(model, apply.STATE_ATTR).offloader
    assert off is not None
    return off


def step(model: nn.Module, example: object, seed: int = 1,
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One tracked forward + backward under a fixed seed: loss, grads, peak bytes."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with MemoryTracker("cpu") as mt:
        loss = step_loss(model, example)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, mt.peak_bytes


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[n] - b[n]).abs().max().item() for n in a)


def mapped_rss(path_part: str) -> int:
    """Resident bytes of this process's mappings of files whose path contains ``path_part``
    (Linux ``/proc/self/smaps``)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                mine = len(fields) >= 6 and path_part in fields[-1]
            elif mine and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def spill_files(off: Offloader) -> list[str]:
    folder = off.spill.folder if off.spill is not None else None
    names = os.listdir(folder) if folder and os.path.isdir(folder) else []
    return sorted(n for n in names if n.endswith(".spill"))
