"""The public entry points: ``enable``, ``disable``, ``pareto``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tightfit.checkpoint import apply
from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.offload import tier_of, tier_speed
from tightfit.checkpoint.plan import (
    MIN_OFFLOAD_BYTES,
    OFFLOADS,
    OffloadMode,
    OffloadTier,
    Plan,
    Segment,
    apply_offload,
    offload_sizes,
    parse_policy,
    structural_segments,
)
from tightfit.checkpoint.profile import profile
from tightfit.checkpoint.solver import frontier, make_plan
from tightfit.model.blocks import resolve_blocks
from tightfit.tiers.regions import tier_capacity
from tightfit.tiers.spill import check_spill_dir


def enable(
    model: nn.Module,
    policy: str = "budget",
    *,
    budget: int | None = None,
    example: Mapping[str, Any] | torch.Tensor | None = None,
    blocks: Sequence[nn.Module] | None = None,
    offload: OffloadMode = "auto",
    offload_host_budget: int | None = None,
    offload_dir: str | None = None,
    profiled: Profile | None = None,
    offload_min_bytes: int = MIN_OFFLOAD_BYTES,
    offload_bandwidth: float | None = None,
) -> Plan:
    """Checkpoint ``model`` according to ``policy`` and return the plan.

    Args:
        model: The model to train (an HF causal LM, a peft model, an ``nn.Sequential``, …).
        policy: ``"none"``, ``"every"``, ``"sqrt"``, ``"uniform:k"`` (k segments),
            ``"budget"`` (least recompute whose predicted peak fits ``budget``) or
            ``"selective"`` (every block, keeping matmul/attention outputs).
        budget: Bytes one forward + backward may allocate on top of what already exists
            (weights, optimizer state). Required by ``"budget"``.
        example: A batch as the model is called with it (a mapping of keyword arguments or
            one tensor). Needed by ``"budget"``; with any other policy it adds the predicted
            peak and recompute to the plan. The model must return a ``.loss`` or a tensor
            (whose sum is used) for it.
        blocks: The chain of layers, in forward order; found automatically when ``None``.
        offload: Where activations may wait for their backward (the vocabulary of
            ``tightfit.prepare``, ``TrainSetup`` and ``tightfit train --offload``).
            ``"auto"``: the budget solver may move a segment's saved tensors, or a
            checkpointed segment's input, to the next tier (pinned host RAM on CUDA, a spill
            file on the CPU) when that is needed to fit or costs less than recomputing;
            fixed policies do not offload. ``"inputs"``: every checkpointed segment's input
            goes to the next tier (the budget solver chooses among stored and
            ``checkpoint_offload``). ``"all"``: that, and stored blocks' saved tensors too
            (``stored_offload``, one block a segment). ``"none"``: nothing moves.
        offload_host_budget: Bytes the offloaded activations may take on the next tier (leave room
            for the paged optimizer's host pages there). ``None``: what the tier has free
            now (free disk of the spill folder; host RAM that can be pinned).
        offload_dir: Folder for the CPU's spill files (``None``: the temp folder).
        profiled: A :func:`~tightfit.checkpoint.profile` of this model and batch to plan
            from instead of ``example`` (profile once, try several policies).
        offload_min_bytes: Saved storages smaller than this stay on the device.
        offload_bandwidth: Bytes/s of a move to the next tier (one way) to plan with,
            instead of measuring it (timed copies through the copy engine, once per device
            and tier); a given bandwidth is planned with no fixed latency.

    Returns:
        The installed :class:`Plan`. Calling ``enable`` again replaces it.

    Raises:
        ValueError / TypeError: Unknown policy, missing or impossible budget, no blocks
            found, an example the model cannot run. The model is left unchanged.
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOADS))}, got "
                         f"{offload!r}.")
    _check_budget(policy, budget, example is not None or profiled is not None)
    tier_args = (offload_host_budget, offload_dir, offload_min_bytes, offload_bandwidth)
    _check_offload_args(*tier_args)
    if _hf_checkpointing_on(model):
        raise ValueError("the model already has Hugging Face gradient checkpointing on; call "
                         "model.gradient_checkpointing_disable() before tightfit.checkpoint."
                         "enable().")
    chain = resolve_blocks(model, blocks)
    if profiled is not None and len(profiled.blocks) != len(chain):
        raise ValueError(f"profiled= has {len(profiled.blocks)} blocks but the model's chain has "
                         f"{len(chain)}; profile this model with the same blocks=.")
    previous = apply.installed(model)  # (plan, its blocks), or None
    apply.uninstall(model)
    try:
        prof = profiled or (None if example is None else profile(model, example, blocks=chain))
        plan = _plan_for(chain, policy, budget, prof, offload, tier_args)
    except BaseException:
        if previous is not None:
            apply.install(model, previous[1], previous[0])  # on the blocks it was on
        raise
    apply.install(model, chain, plan)
    return plan


def _check_budget(policy: str, budget: object, has_example: bool) -> None:
    """Refuse an unknown policy, and a budget policy without its budget and example."""
    name, _ = parse_policy(policy)
    if name == "budget" and (budget is None or not has_example):
        raise ValueError("policy='budget' needs budget=<bytes> and example=<a batch>; or "
                         "pick a fixed policy such as 'every' or 'sqrt'.")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget <= 0):
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}.")


def _plan_for(chain: list[nn.Module], policy: str, budget: int | None, prof: Profile | None,
              offload: OffloadMode, tier_args: tuple) -> Plan:
    """The plan of ``policy``: predicted from ``prof``, or (without one) just its segments."""
    name, k = parse_policy(policy)
    notes: list[str] = []
    fixed = offload in ("inputs", "all")  # what a fixed policy offloads ("auto": nothing)
    if prof is None:
        segments = structural_segments(name, k, len(chain))
        if fixed:
            segments = apply_offload(segments, offload)
        tier = _tier(chain, offload, None, notes, *tier_args)
        return Plan(policy, segments, notes=tuple(notes),
                    tier=tier if any(s.offloads for s in segments) else None)
    # fixed policies offload only when asked to; "auto" is the budget solver's choice
    tier = _tier(chain, offload if name == "budget" or fixed else "none", prof, notes,
                 *tier_args)
    return make_plan(prof, policy, budget=budget, offload=offload,  # type: ignore[arg-type]
                     tier=tier, notes=tuple(notes))


def _check_offload_args(offload_host_budget: object, offload_dir: object, min_bytes: object,
                        bandwidth: object) -> None:
    budget = offload_host_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 0):
        raise ValueError(f"offload_host_budget must be a number of bytes ≥ 0 or None, got "
                         f"{offload_host_budget!r}.")
    if not isinstance(min_bytes, int) or min_bytes < 1:
        raise ValueError(f"offload_min_bytes must be a positive number of bytes, got "
                         f"{min_bytes!r}.")
    if bandwidth is not None and (not isinstance(bandwidth, int | float) or bandwidth <= 0):
        raise ValueError(f"offload_bandwidth must be bytes per second > 0 or None (measure "
                         f"it), got {bandwidth!r}.")
    check_spill_dir(offload_dir)  # type: ignore[arg-type]


def _tier(chain: list[nn.Module], offload: OffloadMode, prof: Profile | None, notes: list[str],
          offload_host_budget: int | None, offload_dir: str | None, min_bytes: int,
          bandwidth: float | None) -> OffloadTier | None:
    """The next tier a plan may offload to (``None`` when it may not), with its room checked
    and, when something is big enough to move, its bandwidth measured."""
    if offload == "none":
        return None
    device = next((p.device for b in chain for p in b.parameters()), torch.device("cpu"))
    name, overlap = tier_of(device)
    room = tier_capacity(name, offload_dir)
    where = "free disk in the spill folder" if name == "disk" else "host RAM that can be pinned"
    if offload_host_budget is not None and offload_host_budget > room:
        notes.append(f"offload_host_budget {offload_host_budget} bytes is more than the "
                     f"{name} tier has now "
                     f"({room} bytes of {where}); planned with {room}.")
    limit = room if offload_host_budget is None else min(offload_host_budget, room)
    movable = prof is not None and any(
        offload_sizes(prof, Segment(i, i + 1, kind), min_bytes)
        for i in range(len(prof.blocks)) for kind in ("stored_offload", "checkpoint_offload"))
    latency = 0.0
    if bandwidth is None:
        bandwidth, latency = tier_speed(device, name, offload_dir) if movable else (0.0, 0.0)
    return OffloadTier(name, float(bandwidth), overlap, min_bytes, limit, offload_dir, latency)


def disable(model: nn.Module) -> Plan | None:
    """Remove tightfit checkpointing from ``model``, restoring it exactly.

    Returns:
        The plan that was installed, or ``None`` if there was none.
    """
    return apply.uninstall(model)


def pareto(
    model: nn.Module,
    example: Mapping[str, Any] | torch.Tensor,
    *,
    blocks: Sequence[nn.Module] | None = None,
    points: int = 24,
) -> list[Plan]:
    """The memory/recompute frontier of ``model`` on ``example`` (nothing is installed).

    Returns:
        Budget plans sorted by predicted peak, each with strictly less predicted recompute
        than the one before it: from the smallest feasible peak to no checkpointing.
    """
    return frontier(profile(model, example, blocks=blocks), points=points)


def _hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether Hugging Face's own per-layer checkpointing is enabled anywhere in ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
