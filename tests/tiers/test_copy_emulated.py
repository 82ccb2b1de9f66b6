"""The accelerator's three tiers (device / pinned host / disk) run on the CPU with CUDA's copy
engine over fake streams: CI coverage of the host-tier logic no GPU run has checked yet.

Emulation only: the CUDA side stream, events and pinned memory are stand-ins (copies run at
once; an event must be recorded before anything waits on it), the "device" is the CPU, and
pages use one buffer each, as on CUDA: the store is built with ``emulate_accelerator=True`` and
CUDA's copy engine (counting its bytes, ``tests/tiers/counting.py``). What it checks is the
store's placement, budgets, traffic and staging — not CUDA itself
(``tests/optim/test_adamw_cuda.py`` does, on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW

from .counting import CountingCudaEngine, count_copies

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAGE = 64 << 10
SIZES = [1, 7, 4097, 100_003]


@pytest.fixture
def accelerator(monkeypatch, strict_cuda):  # noqa: ANN001 (strict_cuda: tests/conftest.py)
    """Returns make(cls, params, **kwargs): a paged optimizer whose store behaves as on CUDA
    (its engine, ``opt.pager.engine``, counts the bytes it copies)."""
    count_copies(monkeypatch, CountingCudaEngine, emulate_accelerator=True)
    made = []

    def make(cls, params, **kwargs):  # noqa: ANN001, ANN003, ANN202
        opt = cls(params, **kwargs)
        assert not opt.pager.on_cpu and not opt.pager.use_slabs  # an accelerator's store
        made.append(opt)
        return opt

    yield make
    for opt in made:
        opt.close()


def _budgets(state: int) -> dict[str, dict]:
    return {
        "unlimited": {},
        "one_page": {"device_budget": PAGE},
        "30%_host": {"device_budget": int(0.3 * state)},
        "30%_host_and_disk": {"device_budget": int(0.3 * state), "host_budget": int(0.3 * state)},
    }


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%_host", "30%_host_and_disk"])
@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_three_tiers_match_torch_and_move_the_minimum(accelerator, paged_cls, torch_cls,
                                                      budget) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(n, generator=gen) for n in SIZES]
    ours = [p.clone() for p in ref]
    kw = _budgets(8 * sum(SIZES))[budget]
    ref_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = accelerator(paged_cls, ours, lr=1e-2, weight_decay=0.1, page_bytes=PAGE, **kw)
    for _ in range(5):
        for r, o in zip(ref, ours):
            r.grad = torch.randn(r.shape, generator=gen)
            o.grad = r.grad.clone()
        before, copied = opt.memory_stats(), opt.pager.engine.counts()
        ref_opt.step()
        opt.step()
        after = opt.memory_stats()
        moved = (after["bytes_paged_in"] - before["bytes_paged_in"]
                 + after["bytes_paged_out"] - before["bytes_paged_out"])  # fmt: skip
        non_resident = after["state_bytes"] - after["resident_bytes"]
        assert moved == 2 * non_resident
        # the engine's own count: each non-resident page loaded once and written back once
        loaded, stored, between = (b - a for a, b in zip(copied, opt.pager.engine.counts()))
        assert loaded == stored == non_resident and between == 0
        assert after["peak_device_bytes"] <= kw.get("device_budget", after["state_bytes"])
    for r, o in zip(ref, ours):
        assert ((o - r).norm() / r.norm()).item() <= 1e-6
    stats = opt.memory_stats()
    host_pages = [p for p in opt.pager.pages if p.tier == "host"]
    assert all(p.buf.is_pinned() for p in host_pages)  # host tier: pinned buffers
    if budget.startswith("30%"):
        assert host_pages and stats["host_bytes"] > 0
    if "host_budget" in kw:
        assert stats["host_bytes"] <= kw["host_budget"] and stats["disk_bytes"] > 0
        assert opt.pager.engine._staging  # disk pages went through pinned staging buffers
    else:
        assert stats["disk_bytes"] == 0  # no host budget: nothing needs the disk
    # a state dict taken from the three tiers loads into torch and continues alike
    torch_opt = torch_cls([p.clone() for p in ours], lr=1e-2, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(opt.state_dict())
    for name in ("exp_avg", "exp_avg_sq"):
        mine = torch_opt.state_dict()["state"][3][name]
        theirs = ref_opt.state_dict()["state"][3][name]
        assert ((mine - theirs).norm() / theirs.norm()).item() <= 1e-6


def test_re_planning_drops_old_staging_buffers(accelerator) -> None:
    ours = [torch.randn(200_000)]
    opt = accelerator(PagedAdamW, ours, page_bytes=PAGE, device_budget=4 * PAGE,
                      host_budget=4 * PAGE)  # fmt: skip
    for limit in (4 * PAGE, 3 * PAGE, 4 * PAGE):
        opt.pager.limit_device(limit, "test")  # new window slots each time
        ours[0].grad = torch.randn_like(ours[0])
        opt.step()
        assert len(opt.pager.engine._staging) <= len(opt.pager.slots)
