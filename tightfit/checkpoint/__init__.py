"""tightfit.checkpoint: gradient checkpointing that places itself.

>>> plan = tightfit.checkpoint.enable(model, "budget", budget=2 << 30, example=batch)
>>> print(plan)        # segments, predicted peak, predicted recompute
>>> tightfit.checkpoint.disable(model)
"""

from tightfit.checkpoint.api import disable, enable, pareto
from tightfit.model.blocks import find_blocks
from tightfit.checkpoint.chain import BlockCost, Profile
from tightfit.checkpoint.plan import POLICIES, Plan, Segment
from tightfit.checkpoint.profile import profile
from tightfit.checkpoint.tiling import Tiling, disable_tiling, enable_tiling, tiling_of

__all__ = ["POLICIES", "BlockCost", "Plan", "Profile", "Segment", "Tiling", "disable",
           "disable_tiling", "enable", "enable_tiling", "find_blocks", "pareto", "profile",
           "tiling_of"]
