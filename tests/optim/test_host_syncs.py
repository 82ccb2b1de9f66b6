"""The sync budget: a paged step makes a fixed number of host syncs, however many params and
pages it has (issue 25, findings 3 and 9, and the sync budget).

Counted under the strict CUDA emulation (``tests/optim/syncs.py``): every optimizer and flag
set docs/optimizers.md offers, resident, streamed through pinned host pages, and on the disk
tier (staged through pinned buffers to the spill file), at 4 and 24 params; then a whole
training step (activation offload + tiled MLP + a streamed optimizer) at 2 and 4 layers.
Before, the non-fused paths read the step counts per update call (one per bucket: per streamed
page), the 8-bit classes' counts lived in the view cache (emptied at 64 entries), PagedLion
read a tensor lr per update call (10 reads a streamed step at 8 params, 79 at 64), and on the
disk tier the stepping thread, helping the copy queue, ran staged write-backs that each waited
for their device-to-host copy (an event synchronize per page: 0-6 a step at 8 params, 68-109
at 64 for fused PagedAdamW).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD

from .syncs import as_on_cuda, step_syncs, training_step_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAGE = 16 << 10
SYNC_BUDGET = 2  # host syncs a paged step may make, whatever its size (docs/optimizers.md)
TIERS: dict[str, dict[str, int]] = {  # where the state lives beyond a one-page device budget
    "resident": {},
    "streamed": {"device_budget": PAGE},  # the rest in pinned host pages
    "disk": {"device_budget": PAGE, "host_budget": PAGE},  # the rest in the spill file
}

CONFIGS: dict[str, tuple[type, dict[str, Any], int]] = {
    # name: (class, kwargs, syncs per step): the step counts read once (tolist), a tensor
    # lr once (item)
    "adamw-fused": (PagedAdamW, {}, 0),
    "adamw-fused-amsgrad": (PagedAdamW, {"amsgrad": True}, 0),
    "adamw-fused-tensor-lr": (PagedAdamW, {"lr": "tensor"}, 0),
    "adamw-foreach": (PagedAdamW, {"foreach": True, "weight_decay": 0.1}, 1),
    "adamw-forloop": (PagedAdamW, {"foreach": False}, 1),
    "adamw-foreach-tensor-lr": (PagedAdamW, {"fused": False, "lr": "tensor"}, 2),
    "adam-foreach-amsgrad": (PagedAdam, {"foreach": True, "amsgrad": True}, 1),
    "adam-forloop-maximize": (PagedAdam, {"foreach": False, "maximize": True,
                                          "weight_decay": 0.1}, 1),  # fmt: skip
    "adamw8bit": (PagedAdamW8bit, {}, 1),
    "adamw8bit-tensor-lr": (PagedAdamW8bit, {"lr": "tensor"}, 2),
    "adamw8bit-foreach-small": (PagedAdamW8bit, {"foreach": True, "min_8bit_size": 1 << 20}, 1),
    "adamw8bit-torch": (PagedAdamW8bit, {"backend": "torch", "foreach": False}, 1),
    "adam8bit": (PagedAdam8bit, {}, 1),
    "lion-foreach": (PagedLion, {}, 0),
    "lion-forloop": (PagedLion, {"foreach": False}, 0),
    "lion-tensor-lr": (PagedLion, {"lr": "tensor"}, 1),
    "lion8bit": (PagedLion8bit, {}, 1),
    "lion8bit-torch-tensor-lr": (PagedLion8bit, {"backend": "torch", "lr": "tensor"}, 1),
    "sgd-fused": (PagedSGD, {"momentum": 0.9, "fused": True}, 0),
    "sgd-foreach": (PagedSGD, {"momentum": 0.9, "foreach": True}, 0),
    "sgd-forloop-nesterov": (PagedSGD, {"momentum": 0.9, "nesterov": True, "foreach": False}, 0),
    "sgd-dampening": (PagedSGD, {"momentum": 0.9, "dampening": 0.1}, 1),
    "sgd-tensor-lr": (PagedSGD, {"momentum": 0.9, "lr": "tensor"}, 1),
}


def _syncs(emu, name: str, n: int, numel: int, tier: str) -> tuple[list[int], int]:  # noqa: ANN001
    """The host syncs of 3 steps, and the bytes on disk after them."""
    cls, kw, _ = CONFIGS[name]
    kw = dict(kw)
    if kw.get("lr") == "tensor":  # on the device (an op made it under the emulation)
        kw["lr"] = torch.full((), 1e-2)
    gen = torch.Generator().manual_seed(n)
    params = [nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(n)]
    opt = cls(params, page_bytes=PAGE, **TIERS[tier], **kw)
    try:
        syncs = step_syncs(emu, opt, params, gen)
        stats = opt.memory_stats()
        assert (stats["resident_bytes"] < stats["state_bytes"]) == (tier != "resident")
        assert (stats["disk_bytes"] > 0) == (tier == "disk"), stats
    finally:
        opt.close()
    return syncs, stats["disk_bytes"]


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_host_syncs_per_step_do_not_grow_with_params_or_pages(strict_cuda, monkeypatch, name,
                                                              tier) -> None:  # fmt: skip
    as_on_cuda(monkeypatch)
    expected = CONFIGS[name][2]
    few, few_disk = _syncs(strict_cuda, name, 4, 4096, tier)
    many, many_disk = _syncs(strict_cuda, name, 24, 4096, tier)
    if tier == "disk":  # more pages on disk, staged through pinned buffers: the same syncs
        assert many_disk >= few_disk + 4 * PAGE, (few_disk, many_disk)
    # the first step places the pages (and may build process-wide constants: the 8-bit maps)
    assert few[1:] == many[1:] == [expected] * 2, (few, many, dict(strict_cuda.syncs))
    assert expected <= SYNC_BUDGET


@pytest.mark.slow
def test_more_than_64_buckets_read_the_step_counts_once(strict_cuda, monkeypatch) -> None:
    """>64 resident buckets in a step (the sweep makes one per streamed page): the view cache
    keeps them all, and the 8-bit step counts, outside it, are read once a step."""
    as_on_cuda(monkeypatch)
    numel = 4096  # the 8-bit kernel's smallest param
    page = 8 << 10
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(300)]
    opt = PagedAdamW8bit(params, page_bytes=page, device_budget=150 * page)
    try:
        syncs = step_syncs(strict_cuda, opt, params, gen)
        stats = opt.memory_stats()
        resident = stats["resident_bytes"] // page
        assert resident > 64 and stats["state_bytes"] // page - resident > 64
        assert len(opt._view_cache) > 64  # every resident bucket still cached
        assert syncs[1:] == [1, 1]
    finally:
        opt.close()


@pytest.mark.parametrize("optimizer", [PagedAdamW, PagedAdamW8bit], ids=["adamw", "adamw8bit"])
def test_a_training_step_with_offload_and_tiling_keeps_the_budget(strict_cuda, monkeypatch,
                                                                  optimizer) -> None:  # fmt: skip
    """Forward: transformers' own packed-sequence check of the position ids (one ``.all()``
    per forward, outside tightfit); backward (the offloaded activations' fetches, the tiles'
    recompute): none; the step: the optimizer's count above."""
    as_on_cuda(monkeypatch)
    few = training_step_syncs(strict_cuda, 2, optimizer)
    many = training_step_syncs(strict_cuda, 4, optimizer)
    per_step = 0 if optimizer is PagedAdamW else 1
    assert few[1:] == many[1:] == [(1, 0, per_step)] * 2, (few, many)
    assert 1 + per_step <= SYNC_BUDGET
