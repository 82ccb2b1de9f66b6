"""tightfit.checkpoint: gradient checkpointing that places itself.

>>> plan = tightfit.checkpoint.enable(model, "budget", budget=2 << 30, example=batch)
>>> print(plan)        # segments, predicted peak, predicted recompute
>>> tightfit.checkpoint.disable(model)

Here:
    api: ``enable``, ``disable``, ``pareto`` (the memory/recompute frontier).
    profile, chain: one example batch profiled per block (``Profile``, ``BlockCost``).
    extrapolate: a long example's profile from shorter crops of it.
    plan: ``Plan`` and ``Segment``, the policies (``POLICIES``), parsing them.
    cost: a plan's predicted peak, recompute and move time.
    solver: the least modelled time whose predicted peak fits a byte budget (exact DP).
    apply: installing a plan on a model and taking it off exactly.
    selective: selective recompute inside a checkpointed block.
    offload: saved tensors waiting on the next tier between forward and backward.
    tiling, tile_cost: tiled MLPs (``enable_tiling``) and what they allocate.
    long_step: the activation plan :func:`tightfit.prepare` installs (checkpoint, offload,
        tiled MLP, loss chunk).

May import measure, model, integrity, tiers and loss (block discovery, ``find_blocks``, is
:mod:`tightfit.model.blocks`, re-exported here). Entry point:
:func:`tightfit.checkpoint.enable`.
"""

from tightfit.checkpoint.api import disable, enable, pareto
from tightfit.checkpoint.chain import BlockCost, Profile
from tightfit.checkpoint.plan import POLICIES, Plan, Segment
from tightfit.checkpoint.profile import profile
from tightfit.checkpoint.tiling import Tiling, disable_tiling, enable_tiling, tiling_of
from tightfit.model.blocks import find_blocks

__all__ = ["POLICIES", "BlockCost", "Plan", "Profile", "Segment", "Tiling", "disable",
           "disable_tiling", "enable", "enable_tiling", "find_blocks", "pareto", "profile",
           "tiling_of"]
