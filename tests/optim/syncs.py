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

import tightfit.checkpoint as ck
from tightfit.checkpoint.plan import OffloadTier
from tightfit.checkpoint.profile import step_loss
from tightfit.checkpoint.tiling import enable_tiling
from tightfit.tiers.copy import CudaCopyEngine

from ..checkpoint.conftest import tiny_llama
from ..checkpoint.offloaded import MIN_BYTES, install
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


def training_step_syncs(emu: StrictCuda, layers: int, optimizer: type,
                        page_bytes: int = 16 << 10) -> list[tuple[int, int, int]]:
    """(forward, backward, step) host syncs of 3 training steps of a tiny Llama with every
    block's activations offloaded to pinned host memory, its MLPs tiled, and its params'
    state streamed (``benchmarks/syncs.py`` reports the same scenario)."""
    torch.manual_seed(0)
    model = tiny_llama(layers=layers, hidden=64, vocab=256)
    x = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": x, "labels": x}
    tier = OffloadTier("host", 1e9, True, MIN_BYTES)
    install(model, ck.profile(model, batch), ["stored_offload", "checkpoint_offload"], tier=tier)
    enable_tiling(model, 16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, page_bytes=page_bytes, device_budget=4 * page_bytes)
    out = []
    try:
        box: list[torch.Tensor] = []
        for _ in range(3):
            box.clear()
            forward = syncs_of(emu, lambda: box.append(step_loss(model, batch)))
            backward = syncs_of(emu, lambda: box[0].backward())
            step = syncs_of(emu, opt.step)
            opt.zero_grad()
            out.append((sum(forward.values()), sum(backward.values()), sum(step.values())))
        assert opt.memory_stats()["resident_bytes"] < opt.memory_stats()["state_bytes"]
    finally:
        opt.close()
        ck.disable(model)
    return out
