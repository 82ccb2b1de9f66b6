"""tightfit.checkpoint: gradient checkpointing that places itself.

>>> plan = tightfit.checkpoint.enable(model, "budget", budget=2 << 30, example=batch)
>>> print(plan)        # segments, predicted peak, predicted recompute
>>> tightfit.checkpoint.disable(model)
"""

from tightfit.checkpoint.api import disable, enable
from tightfit.checkpoint.blocks import find_blocks
from tightfit.checkpoint.plan import POLICIES, Plan, Segment

__all__ = ["POLICIES", "Plan", "Segment", "disable", "enable", "find_blocks"]
