"""A paged step reads step counts and tensor hyperparameters from the device a fixed number of
times, however many params and pages it has (issue 25, findings 3 and 9).

On CUDA every read is a device sync (``tests/optim/syncs.py``). The non-fused paths read the
step counts per update call (one per bucket: per streamed page) before, and the 8-bit
classes' once-per-step counts lived in the view cache, which was emptied at 64 entries.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdamW8bit
from tightfit.optim.sgd import PagedSGD

from .syncs import count_host_reads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAGE = 16 << 10

CONFIGS: dict[str, tuple[type, dict[str, Any], int]] = {
    # name: (class, kwargs, reads per step)
    "adamw-fused": (PagedAdamW, {}, 0),
    "adamw-foreach": (PagedAdamW, {"foreach": True, "weight_decay": 0.1}, 1),
    "adamw-forloop": (PagedAdamW, {"foreach": False}, 1),
    "adam-foreach-amsgrad": (PagedAdam, {"foreach": True, "amsgrad": True}, 1),
    "adamw-foreach-tensor-lr": (PagedAdamW, {"fused": False, "lr": "tensor"}, 2),  # foreach
    "adamw8bit": (PagedAdamW8bit, {}, 1),
    "adamw8bit-foreach-small": (PagedAdamW8bit, {"foreach": True, "min_8bit_size": 1 << 20}, 1),
    "adamw8bit-torch": (PagedAdamW8bit, {"backend": "torch", "foreach": False}, 1),
    "sgd-dampening": (PagedSGD, {"momentum": 0.9, "dampening": 0.1}, 1),
    "sgd-tensor-lr": (PagedSGD, {"momentum": 0.9, "lr": "tensor"}, 1),
}


def _step_reads(monkeypatch, opt, params: list[nn.Parameter], gen: torch.Generator,
                steps: int = 3) -> list[int]:
    """The host reads of each of ``steps`` steps, fresh random grads before each."""
    reads = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.numel(), generator=gen)
        with count_host_reads(monkeypatch) as count:
            opt.step()
        reads.append(count[0])
    return reads


def _reads(monkeypatch, name: str, n: int, numel: int, budget: int | None) -> list[int]:
    cls, kw, _ = CONFIGS[name]
    kw = dict(kw)
    if kw.get("lr") == "tensor":
        kw["lr"] = torch.tensor(1e-2)
    gen = torch.Generator().manual_seed(n)
    params = [nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(n)]
    opt = cls(params, page_bytes=PAGE, device_budget=budget, **kw)
    try:
        reads = _step_reads(monkeypatch, opt, params, gen)
        assert opt.memory_stats()["resident_bytes"] < opt.memory_stats()["state_bytes"] or not budget
    finally:
        opt.close()
    return reads


@pytest.mark.parametrize("budget", [None, 2 * PAGE], ids=["resident", "streamed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_host_reads_per_step_do_not_grow_with_params_or_pages(monkeypatch, name, budget) -> None:
    expected = CONFIGS[name][2]
    few = _reads(monkeypatch, name, 8, 5000, budget)
    many = _reads(monkeypatch, name, 64, 5000, budget)
    # the step's counts once, a tensor lr once (the first step may build process-wide
    # constants: the 8-bit maps)
    assert few[1:] == many[1:] == [expected] * 2, (few, many)


def test_more_than_64_buckets_read_the_step_counts_once(monkeypatch) -> None:
    """>64 resident buckets in a step (the sweep makes one per streamed page): the view cache
    keeps them all, and the 8-bit step counts, outside it, are read once a step."""
    numel = 4096  # the 8-bit kernel's smallest param: 2 pages of 8 KiB state... per 2 params
    page = 8 << 10
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(300)]
    opt = PagedAdamW8bit(params, page_bytes=page, device_budget=150 * page)
    try:
        reads = _step_reads(monkeypatch, opt, params, gen)
        stats = opt.memory_stats()
        resident = stats["resident_bytes"] // page
        assert resident > 64 and stats["state_bytes"] // page - resident > 64
        assert len(opt._view_cache) > 64  # every resident bucket still cached
        assert reads[1:] == [1, 1]
    finally:
        opt.close()
