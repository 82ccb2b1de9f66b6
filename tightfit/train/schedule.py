"""The learning rate of each step: linear warmup, then constant, or a linear or cosine decay.

A pure function of the step (a resumed run needs no scheduler state), equal to torch's own
schedulers composed the usual way (tested against them in tests/train/test_schedule.py)::

    warmup = LinearLR(opt, start_factor=1 / W, total_iters=W - 1)
    decay  = ConstantLR(opt, factor=1, total_iters=0)                 # constant
           | LinearLR(opt, start_factor=1, end_factor=0, total_iters=T - W)   # linear
           | CosineAnnealingLR(opt, T_max=T - W)                      # cosine, to 0
    SequentialLR(opt, [warmup, decay], milestones=[W])

so the first step already trains (lr / W), the peak is reached at step W, and a decay ends at
0 one step after the last (``T = --steps``).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, schedule: str, warmup: int, total: int) -> float:
    """The learning rate of 0-based ``step`` of a ``total``-step run.

    Args:
        step: The step about to run (0 is the first).
        lr: The peak learning rate.
        schedule: ``constant``, ``linear`` or ``cosine`` after the warmup.
        warmup: Linear warmup steps (0: none).
        total: The run's steps (the decay's horizon).
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return lr * (1.0 - progress)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown --lr-schedule {schedule!r}; use constant, linear or cosine.")
