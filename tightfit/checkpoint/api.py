"""The public entry points: ``enable``, ``disable``, ``pareto``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tightfit.checkpoint import apply
from tightfit.checkpoint.blocks import resolve_blocks
from tightfit.checkpoint.chain import Profile
from tightfit.checkpoint.plan import Plan, parse_policy, structural_segments
from tightfit.checkpoint.profile import profile
from tightfit.checkpoint.solver import frontier, make_plan


def enable(
    model: nn.Module,
    policy: str = "budget",
    *,
    budget: int | None = None,
    example: Mapping[str, Any] | torch.Tensor | None = None,
    blocks: Sequence[nn.Module] | None = None,
    offload: bool = False,
    profiled: Profile | None = None,
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
        offload: Keep checkpointed segment inputs on the host until backward (CUDA only;
            a no-op on the CPU, noted in the plan).
        profiled: A :func:`~tightfit.checkpoint.profile` of this model and batch to plan
            from instead of ``example`` (profile once, try several policies).

    Returns:
        The installed :class:`Plan`. Calling ``enable`` again replaces it.

    Raises:
        ValueError / TypeError: Unknown policy, missing or impossible budget, no blocks
            found, an example the model cannot run. The model is left unchanged.
    """
    name, k = parse_policy(policy)
    if name == "budget" and (budget is None or (example is None and profiled is None)):
        raise ValueError("policy='budget' needs budget=<bytes> and example=<a batch>; or "
                         "pick a fixed policy such as 'every' or 'sqrt'.")
    if budget is not None and (not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}.")
    if _hf_checkpointing_on(model):
        raise ValueError("the model already has Hugging Face gradient checkpointing on; call "
                         "model.gradient_checkpointing_disable() before tightfit.checkpoint."
                         "enable().")
    chain = resolve_blocks(model, blocks)
    if profiled is not None and len(profiled.blocks) != len(chain):
        raise ValueError(f"profiled= has {len(profiled.blocks)} blocks but the model's chain has "
                         f"{len(chain)}; profile this model with the same blocks=.")
    notes: list[str] = []
    if offload and not any(p.is_cuda for p in model.parameters()):
        notes.append("offload=True is a no-op on the CPU: segment inputs already live in host "
                     "memory.")
    previous = apply.installed(model)  # (plan, its blocks), or None
    apply.uninstall(model)
    try:
        if example is None and profiled is None:
            segments = structural_segments(name, k, len(chain))
            plan = Plan(policy, segments, offload=offload, notes=tuple(notes))
        else:
            prof = profiled or profile(model, example, blocks=chain)
            plan = make_plan(prof, policy, budget=budget, offload=offload, notes=tuple(notes))
    except BaseException:
        if previous is not None:
            apply.install(model, previous[1], previous[0])  # on the blocks it was on
        raise
    apply.install(model, chain, plan)
    return plan


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
