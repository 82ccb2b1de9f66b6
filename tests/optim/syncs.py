"""Counting a paged step's host syncs under the strict CUDA emulation.

On CUDA, ``.item()``, ``.tolist()``, ``float(t)``, a tensor passed where a number is expected,
``synchronize()`` and blocking copies hold the host until the device has caught up. The
strict emulation (``tests/tiers/strict_cuda.py``, fixture ``strict_cuda``) counts each of
them by kind on the test's threads (``StrictCuda.syncs``); here a paged optimizer is built as
on an accelerator (CUDA's copy engine, one buffer per page, pinned host pages) and its steps
are counted one by one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from tightfit.tiers.copy import CudaCopyEngine

from ..tiers.counting import count_copies
from ..tiers.strict_cuda import StrictCuda


def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged optimizers made from now on build their store as on CUDA (its copy engine)."""
    count_copies(monkeypatch, CudaCopyEngine, emulate_accelerator=True)


def syncs_of(emu: StrictCuda, fn: Callable[[], object]) -> Counter[str]:
    """The host syncs ``fn()`` makes, by kind."""
    before = Counter(emu.syncs)
    fn()
    return Counter(emu.syncs) - before


def step_syncs(emu: StrictCuda, opt: torch.optim.Optimizer, params: Iterable[nn.Parameter],
               gen: torch.Generator, steps: int = 3) -> list[int]:
    """The host syncs of each of ``steps`` steps (all kinds), fresh random grads before each
    (set outside the count)."""
    params = list(params)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        out.append(sum(syncs_of(emu, opt.step).values()))
    return out
