"""Page store: residency under budgets, exact traffic, eviction/restore, events, cleanup."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tightfit.integrity.owners import OWNER_FILE
from tightfit.measure.tracker import MemoryTracker
from tightfit.optim.adamw import PagedAdamW
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore

from ..tiers.counting import CountingEngine, count_copies, payload_bytes

PAGE = 16 << 10


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _opt(budget, sizes=(30_000, 5, 12_000), **kw):
    params = [torch.randn(n) for n in sizes]
    return params, PagedAdamW(params, lr=1e-2, page_bytes=PAGE, device_budget=budget, **kw)


def _step(params, opt, n=1):
    for _ in range(n):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def _state(opt):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


def test_resident_prefix_window_and_disk() -> None:
    params, opt = _opt(5 * PAGE)
    tiers, slots = opt.pager.plan()
    assert slots == 2
    n_dev = tiers.count("device")
    assert tiers == ["device"] * n_dev + ["disk"] * (len(tiers) - n_dev)  # a fixed prefix
    _step(params, opt)
    s = opt.memory_stats()
    assert s["resident_bytes"] + s["window_bytes"] == s["device_bytes"] <= 5 * PAGE
    assert s["resident_bytes"] + s["disk_bytes"] == s["state_bytes"]
    assert s["host_bytes"] == 0  # on the CPU, device and host are one tier
    opt.close()


@pytest.mark.parametrize("budget", [PAGE, 2 * PAGE, 4 * PAGE + 100])
def test_each_step_moves_exactly_twice_the_non_resident_bytes(monkeypatch, budget) -> None:
    count_copies(monkeypatch)
    params, opt = _opt(budget)
    engine = opt.pager.engine
    _step(params, opt)
    for _ in range(3):
        before, copied = opt.memory_stats(), engine.counts()
        _step(params, opt)
        after = opt.memory_stats()
        non_resident = after["state_bytes"] - after["resident_bytes"]
        assert after["disk_bytes"] == non_resident > 0
        moved = (after["bytes_paged_in"] - before["bytes_paged_in"]) + (
            after["bytes_paged_out"] - before["bytes_paged_out"])
        assert moved == 2 * non_resident
        # what the copy engine really copied: each disk page in once and out once, no more
        loaded, stored, between = (b - a for a, b in zip(copied, engine.counts()))
        assert loaded == stored == non_resident and between == 0
        streamed = sum(1 for p in opt.pager.pages if p.tier == "disk")
        assert after["page_faults"] - before["page_faults"] == streamed
        assert after["peak_device_bytes"] <= budget
    opt.close()


def test_evict_and_restore_keep_the_state_and_log_events() -> None:
    params, opt = _opt(None)
    _step(params, opt, 2)
    full = opt.memory_stats()["device_bytes"]
    reference = _state(opt)
    freed = opt.pager.evict_bytes(full // 2, reason="test: activations need room")
    s = opt.memory_stats()
    assert freed == full - s["device_bytes"] and freed >= full // 2
    assert s["disk_bytes"] > 0 and s["device_bytes"] <= full - full // 2
    ev = opt.pager.events.events[-1]
    assert (ev.kind, ev.src, ev.dst) == ("evict", "device", "disk")
    assert ev.reason == "test: activations need room" and ev.nbytes == s["disk_bytes"]
    after = _state(opt)
    for i in reference:
        for k in reference[i]:
            assert torch.equal(reference[i][k], after[i][k])
    # a step while evicted streams the evicted pages; then restore everything
    _step(params, opt)
    added = opt.pager.restore_bytes(None, reason="pressure gone")
    s = opt.memory_stats()
    assert s["disk_bytes"] == 0 and s["window_bytes"] == 0 and added > 0
    assert opt.pager.events.events[-1].kind == "restore"
    opt.close()


def test_peak_never_exceeds_budget_through_limit_changes() -> None:
    budget = 6 * PAGE
    params, opt = _opt(budget)
    _step(params, opt)
    for limit in (PAGE, 3 * PAGE, None, 2 * PAGE):
        opt.pager.limit_device(limit, reason="test")
        _step(params, opt)
        assert opt.memory_stats()["peak_device_bytes"] <= budget
        assert opt.memory_stats()["device_bytes"] <= (limit or budget)
    with pytest.raises(ValueError, match="below one page"):
        opt.pager.limit_device(PAGE - 1, reason="test")
    opt.close()


def test_spill_files_are_gone_after_close(tmp_path) -> None:
    params, opt = _opt(PAGE, spill_dir=tmp_path)
    _step(params, opt)
    folder = opt.memory_stats()["spill_dir"]
    files = sorted(os.listdir(folder))
    assert files == ["group0.spill", OWNER_FILE]  # the spill file and who made it
    opt.close()
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []


def test_default_spill_folder_is_temporary_and_removed() -> None:
    params, opt = _opt(PAGE)
    _step(params, opt)
    folder = opt.memory_stats()["spill_dir"]
    assert os.path.isdir(folder)
    del opt  # no close(): the finalizer still frees the pages and deletes the files
    gc.collect()
    assert not os.path.exists(folder)


def test_clean_pages_leave_the_device_without_a_write(monkeypatch) -> None:
    count_copies(monkeypatch)
    params, opt = _opt(None)
    engine = opt.pager.engine
    _step(params, opt)
    full = opt.memory_stats()["device_bytes"]
    opt.pager.evict_bytes(full // 2, reason="spike")  # dirty pages: written to the spill file
    out1 = opt.memory_stats()["bytes_paged_out"]
    assert out1 > 0
    on_disk = [p for p in opt.pager.pages if p.tier == "disk"]
    # the engine copied each evicted page's arrays (one copy per array from a slab)
    assert engine.moved == payload_bytes(on_disk) > 0
    assert out1 == sum(p.nbytes for p in on_disk)
    opt.pager.restore_bytes(None, reason="spike over")  # read back, not modified
    assert engine.moved == 2 * payload_bytes(on_disk)
    reference = _state(opt)
    opt.pager.evict_bytes(full // 2, reason="spike again")  # the spill copy is still current
    s = opt.memory_stats()
    assert s["bytes_paged_out"] == out1 and s["disk_bytes"] > 0
    assert engine.moved == 2 * payload_bytes(on_disk)  # not a byte copied: no write
    assert opt.pager.events.events[-1].nbytes == s["disk_bytes"]  # state that changed tier
    after = _state(opt)
    for i in reference:
        for k in reference[i]:
            assert torch.equal(reference[i][k], after[i][k])
    # after an update the pages are dirty again and must be written
    opt.pager.restore_bytes(None, reason="back")
    _step(params, opt)
    opt.pager.evict_bytes(full // 2, reason="after a step")
    assert opt.memory_stats()["bytes_paged_out"] > out1
    opt.close()


def test_measured_allocations_stay_within_the_budget() -> None:
    """Live tensor bytes counted by MemoryTracker: the budget and the step counters, nothing
    else — no hidden temporaries (the spill-file mapping is the disk tier, not counted)."""
    params = [torch.randn(200_000), torch.randn(50_000)]
    for p in params:
        p.grad = torch.randn_like(p)
    budget = 6 * PAGE
    with MemoryTracker() as tracker:
        opt = PagedAdamW(params, page_bytes=PAGE, device_budget=budget)
        for _ in range(3):
            opt.step()
    # every device byte is seen (CPU slabs announce their pages to the tracker), nothing more
    # than the budget and the two 4-byte step counters
    device = opt.memory_stats()["device_bytes"]
    assert opt.memory_stats()["disk_bytes"] > 0  # the spill file is in use
    assert device <= tracker.peak_bytes <= budget + 4 * len(params)
    assert opt.memory_stats()["peak_device_bytes"] <= budget
    opt.close()


def test_the_store_tells_its_listeners_before_every_move_and_on_close() -> None:
    params, opt = _opt(None)
    calls: list[tuple[str, int]] = []
    store = opt.pager
    store.on_move(lambda: calls.append(("move", store.device_bytes)))
    _step(params, opt)  # the first step places the pages
    assert calls == [("move", 0)]  # told before any page was allocated
    full = store.device_bytes
    store.evict_bytes(full // 2, reason="test")
    store.limit_device(None, reason="test")  # and back: every re-plan tells
    assert calls == [("move", 0), ("move", full), ("move", calls[2][1])]
    assert calls[2][1] < full  # the third call came before the pages came back
    opt.close()
    assert len(calls) == 4


def test_a_store_uses_and_closes_the_engine_it_is_given(tmp_path) -> None:
    closed: list[bool] = []

    class Engine(CountingEngine):
        def close(self) -> None:
            closed.append(True)
            super().close()

    engine = Engine()
    store = PageStore(torch.device("cpu"), PagingOptions(PAGE, spill_dir=tmp_path), engine=engine)
    assert store.engine is engine and store.on_cpu
    with pytest.raises(AttributeError):
        store.on_cpu = False  # derived from the device, never assigned
    store.close()
    assert closed == [True]
