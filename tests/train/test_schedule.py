"""The learning-rate schedule against torch's own schedulers, step by step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    SequentialLR,
)

from tightfit.train.schedule import lr_at


def _torch_lrs(schedule: str, lr: float, warmup: int, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    if schedule == "constant":
        decay = ConstantLR(opt, factor=1.0, total_iters=0)
    elif schedule == "linear":
        decay = LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=total - warmup)
    else:
        decay = CosineAnnealingLR(opt, T_max=total - warmup)
    sched = decay
    if warmup:
        warm = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        sched = SequentialLR(opt, [warm, decay], milestones=[warmup])
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 20), (5, 40), (10, 11)])
def test_schedule_equals_torchs_schedulers(schedule: str, warmup: int, total: int) -> None:
    ours = [lr_at(s, lr=2e-4, schedule=schedule, warmup=warmup, total=total)
            for s in range(total)]
    theirs = _torch_lrs(schedule, 2e-4, warmup, total)
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(ours, theirs)), (
        list(zip(ours, theirs)))
    if warmup:
        assert ours[0] == pytest.approx(2e-4 / warmup) and ours[warmup] == pytest.approx(2e-4)
    if schedule != "constant" and total - warmup > 4:
        assert ours[-1] < ours[warmup] / 4  # it does decay


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="constant, linear or cosine"):
        lr_at(20, lr=1.0, schedule="step", warmup=0, total=40)
