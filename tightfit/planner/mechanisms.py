"""The long-context mechanisms a verify step installs, where :mod:`tightfit.checkpoint` has them.

Activation offload (segments of kind ``checkpoint_offload`` / ``stored_offload``) and the
tiled MLP (:mod:`tightfit.checkpoint.tiling`) are built in :mod:`tightfit.checkpoint`; the
planner models them either way, but can only *measure* a setup that uses them once they are
there. :func:`unavailable` says why a setup cannot be measured on this checkout (``None``
when it can); the install functions put a setup's mechanisms on a model the way
``tightfit.checkpoint`` would.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from tightfit.checkpoint.plan import Segment
    from tightfit.planner.train_setup import TrainSetup


def offload_reason() -> str | None:
    """Why offloaded segments cannot be installed here (``None``: they can)."""
    from tightfit.checkpoint import plan

    if "checkpoint_offload" not in getattr(plan, "KINDS", ()) or not hasattr(plan, "OffloadTier"):
        return ("tightfit.checkpoint has no offload placements (segment kinds "
                "checkpoint_offload / stored_offload) in this checkout")
    return None


def tiling_reason() -> str | None:
    """Why the tiled MLP cannot be installed here (``None``: it can)."""
    if importlib.util.find_spec("tightfit.checkpoint.tiling") is None:
        return "tightfit.checkpoint.tiling does not exist in this checkout"
    return None


def unavailable(setup: TrainSetup) -> str | None:
    """Why ``setup`` cannot be run for real on this checkout (``None``: it can)."""
    reasons = []
    if setup.offload != "none" and (why := offload_reason()):
        reasons.append(why)
    if setup.mlp_tile is not None and (why := tiling_reason()):
        reasons.append(why)
    return "; ".join(reasons) or None


def install_tiling(model: nn.Module, setup: TrainSetup) -> None:
    """Tile every decoder layer's MLP in ``setup.mlp_tile`` tokens (nothing when untiled)."""
    if setup.mlp_tile is None:
        return
    from tightfit.checkpoint.tiling import enable_tiling

    enable_tiling(model, setup.mlp_tile)


def install_segments(model: nn.Module, segments: tuple[Segment, ...]) -> None:
    """Install ``segments`` as a :mod:`tightfit.checkpoint` plan (its recompute and offload).

    Offloaded segments go to the device's next tier (a spill file on the CPU) with every
    storage moved, however small (``min_bytes=1``): the planner's model moves them all, and
    the small shapes a verify step runs have no storage above the default 1 MiB.
    """
    from tightfit.checkpoint import apply
    from tightfit.checkpoint.plan import Plan
    from tightfit.model.blocks import resolve_blocks

    apply.uninstall(model)
    blocks = resolve_blocks(model, None)
    if any(seg.kind.endswith("_offload") for seg in segments):
        from tightfit.checkpoint.offload import tier_of
        from tightfit.checkpoint.plan import OffloadTier

        device = next(model.parameters()).device
        name, overlap = tier_of(device)
        plan = Plan("verify", tuple(segments), tier=OffloadTier(name, 0.0, overlap, min_bytes=1))
    else:
        plan = Plan("verify", tuple(segments))
    apply.install(model, blocks, plan)
