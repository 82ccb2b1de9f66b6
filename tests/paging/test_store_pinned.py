"""The page store's host tier counted as pinned: regions of pinned chunks (as asked, no
power-of-two rounding), the room pinned before any page moves, nothing pinned after close,
one budget with the offloaded activations. Under the strict CUDA emulation and the pinned
allocator's (``tests/tiers/strict_pinned.py``)."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.optim.base import PagedOptimizer
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore
from tightfit.tiers import pinned
from tightfit.tiers.pinned import PinnedHost, TierFullError
from tightfit.tiers.regions import aligned, pinned_pool

from ..tiers.strict_pinned import strict_pinned  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE = 96 << 10  # not a power of two: torch's allocator would pin 128 KiB a page


@pytest.fixture
def accelerator(monkeypatch, strict_cuda, strict_pinned):  # noqa: ANN001, F811
    """PagedAdamW whose store has an accelerator's tiers on the CPU; returns (make, emu)."""

    def new_store(self: PagedOptimizer, device: torch.device, paging: PagingOptions) -> PageStore:
        return PageStore(device, paging, slabs=False, emulate_accelerator=True)

    monkeypatch.setattr(PagedOptimizer, "_new_store", new_store)
    made: list[PagedAdamW] = []

    def make(**kw):  # noqa: ANN003, ANN202
        params = [torch.nn.Parameter(torch.randn(n)) for n in (30_000, 50_001, 7)]
        opt = PagedAdamW(params, lr=1e-2, page_bytes=PAGE, **kw)
        made.append(opt)
        return opt, params

    yield make, strict_pinned
    for opt in made:
        opt.close()


def _step(opt: PagedAdamW, params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def test_host_pages_pin_what_they_hold_and_closing_unpins_them(accelerator) -> None:
    make, emu = accelerator
    opt, params = make(device_budget=2 * PAGE)
    _step(opt, params)
    store = opt.pager
    host = [p for p in store.pages if p.tier == "host"]
    assert host and all(p.buf.is_pinned() for p in host)
    # a region of one page's size each (no fragmentation), not a power of two
    assert store.host_pinned_bytes() == len(host) * aligned(PAGE)
    staging = 0  # host pages copy directly: no staging buffers
    assert emu.pinned_bytes == store.host_pinned_bytes() + staging
    assert emu.allocator_bytes == 0  # nothing through torch's rounding, caching allocator
    before = emu.pinned_bytes
    for _ in range(3):  # pressure: everything back, then out again
        store.limit_device(None, "test: room")
        store.limit_device(2 * PAGE, "test: spike")
        _step(opt, params)
    assert emu.pinned_bytes == before  # regions reused, nothing new pinned
    assert opt.memory_stats()["host_pinned_bytes"] == before
    opt.close()
    assert emu.pinned_bytes == 0 and emu.registered == {}


def test_a_shared_budget_refuses_the_host_pages_before_any_page_moves(accelerator) -> None:
    make, emu = accelerator
    host = PinnedHost(budget=12 * PAGE)
    with pinned.sharing(host):
        offload = pinned_pool(10 * PAGE, None, host=host)  # offloaded activations took most
        opt, params = make(device_budget=2 * PAGE)
    offload.take(10 * PAGE)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.raises(TierFullError, match=r"optimizer host pages would pass the host budget"):
        opt.step()
    assert all(p.tier == "new" for p in opt.pager.pages)  # nothing placed or half-moved
    assert host.pinned_bytes == emu.pinned_bytes == 10 * PAGE
    offload.close()
    _step(opt, params)  # the room is back: the step runs
    assert host.pinned_bytes == emu.pinned_bytes == opt.pager.host_pinned_bytes() > 0
    opt.close()
    assert host.pinned_bytes == emu.pinned_bytes == 0


def test_disk_pages_stage_through_counted_buffers_released_on_close(accelerator) -> None:
    make, emu = accelerator
    opt, params = make(device_budget=2 * PAGE, host_budget=PAGE)
    _step(opt, params)
    store = opt.pager
    assert any(p.tier == "disk" for p in store.pages)
    staged = emu.pinned_bytes - store.host_pinned_bytes()
    assert staged == sum(aligned(s.numel()) for s in store.slots)  # one per window slot
    assert store.pinned.by_user["staging buffers"] == staged
    registered, registrations = dict(emu.registered), emu.registrations
    for limit in (3 * PAGE, 2 * PAGE):  # re-plans: new slots, the same staging buffers
        store.limit_device(limit, "test: re-plan")
        _step(opt, params)
    assert emu.registered == registered and emu.registrations == registrations  # no re-locking
    opt.close()
    assert emu.pinned_bytes == 0
