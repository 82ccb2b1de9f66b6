"""CUDA's copy engine and the activation offload under the strict stream emulation
(``tests/tiers/strict_cuda.py``): every cross-stream use ordered, and every device tensor a
side stream used protected from the caching allocator when it is freed (issue 25, findings 4
and 5).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tightfit.checkpoint.offload import Offloader
from tightfit.checkpoint.plan import OffloadTier
from tightfit.optim.adamw import PagedAdamW
from tightfit.tiers.copy import CudaCopyEngine

from .counting import CountingCudaEngine, count_copies

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def strict(strict_cuda):  # noqa: ANN001, ANN201 (tests/conftest.py)
    return strict_cuda


@pytest.mark.parametrize("home", ["pinned", "staged"])
def test_load_waits_for_the_compute_stream(strict, home) -> None:
    """A slot the compute just wrote (an update that then failed: no store() ordered it) is
    refilled on the side stream only after that write."""
    engine = CudaCopyEngine(torch.device("cpu"))
    try:
        src = torch.arange(4096).to(torch.uint8)  # pages are bytes
        page = torch.empty(4096, dtype=torch.uint8, pin_memory=home == "pinned")
        page.copy_(src)
        slot = torch.zeros(4096, dtype=torch.uint8)
        slot.add_(1)  # the compute's last use of the slot
        engine.wait(engine.load(page, slot))
        assert ("wait_event", engine.stream.name, "compute") in strict.calls
        assert strict.violations == []
        assert torch.equal(slot, src)
    finally:
        engine.close()


def _offloader() -> Offloader:
    tier = OffloadTier("host", 1e9, True, 0)
    return Offloader(torch.device("cpu"), tier, num_segments=1, host_bytes=1 << 20)


def test_a_prefetched_buffer_dropped_before_unpack_is_protected(strict) -> None:
    """The backward fetched segment 0 ahead (into memory allocated on the compute stream,
    written on the side stream), then the graph died before unpacking it (a backward that
    raised): its memory must not go back to the allocator before the compute waited for the
    copy (or record_stream)."""
    off = _offloader()
    try:
        x = torch.randn(4096, requires_grad=True)
        with off.hooks(0, set()):
            y = (x * 2).exp()  # exp saves its output: offloaded
        off.forward_done()
        off.segment_backward(1)  # prefetches segment 0
        assert off.bytes_fetched > 0
        del y
        gc.collect()
        assert strict.violations == []
    finally:
        off.close()


def test_an_offload_round_trip_is_stream_ordered(strict) -> None:
    off = _offloader()
    try:
        x = torch.randn(4096, requires_grad=True)
        with off.hooks(0, set()):
            y = (x * 2).exp()
        off.forward_done()
        off.segment_backward(1)
        y.sum().backward()
        assert torch.allclose(x.grad, 2 * (x.detach() * 2).exp())
        del y
        gc.collect()
        assert strict.violations == []
    finally:
        off.close()


def test_a_streamed_paged_step_is_stream_ordered(strict, monkeypatch) -> None:
    """Pages through the window slots (load, update, store): every side-stream copy ordered
    against the compute's use of the slots. (Before load() waited on the compute stream, the
    first load into a fresh slot was not: a new slot may reuse memory the compute just freed
    and still reads.)"""
    count_copies(monkeypatch, CountingCudaEngine, emulate_accelerator=True)
    page = 16 << 10
    params = [torch.nn.Parameter(torch.randn(3000)) for _ in range(6)]
    opt = PagedAdamW(params, page_bytes=page, device_budget=2 * page, foreach=False)
    try:
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(3000)
            opt.step()
        assert opt.memory_stats()["resident_bytes"] < opt.memory_stats()["state_bytes"]
        assert strict.violations == []
    finally:
        opt.close()


# -- the emulation itself: what it must catch ---------------------------------------------


def test_a_side_stream_copy_lands_later_and_only_a_wait_orders_it(strict) -> None:
    side = torch.cuda.Stream()
    src = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    early = dst.sum()  # no wait: a race (and, most likely, the old bytes)
    assert strict.violations and "without waiting" in strict.violations[0]
    strict.violations.clear()
    torch.cuda.current_stream().wait_event(done)
    assert dst.sum().item() == 7 << 16 and done.query()
    del early


def test_a_freed_block_is_reused_at_once_and_poisoned(strict) -> None:
    a = torch.empty(1000, dtype=torch.float32)
    a.fill_(1.0)
    ptr = a.data_ptr()
    del a
    b = torch.empty(900, dtype=torch.float32)  # the same stream's next request: the same block
    assert b.data_ptr() == ptr and strict.allocator.reused == 1
    assert torch.isnan(b).all()  # poison, not the old values


@pytest.mark.parametrize("protect", [None, "record_stream", "wait"])
def test_a_block_freed_while_a_side_copy_writes_it(strict, protect) -> None:
    side = torch.cuda.Stream()
    home = torch.empty(1 << 18, dtype=torch.uint8, pin_memory=True).fill_(3)
    dst = torch.empty(1 << 18, dtype=torch.uint8)
    ready = torch.cuda.Event()
    ready.record()
    side.wait_event(ready)
    with torch.cuda.stream(side):
        dst.copy_(home, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    if protect == "record_stream":
        dst.record_stream(side)
    elif protect == "wait":
        torch.cuda.current_stream().wait_event(done)
    ptr = dst.data_ptr()
    del dst  # dropped unread (a backward that raised)
    new = torch.empty(1 << 18, dtype=torch.uint8)
    if protect is None:
        assert strict.violations and "record_stream" in strict.violations[0]
        assert new.data_ptr() == ptr  # reused at once: the late copy lands in the new tensor
        strict.violations.clear()
    else:
        assert strict.violations == []
        assert new.data_ptr() != ptr or protect == "wait"


def test_backward_runs_on_another_thread_with_the_callers_modes(strict) -> None:
    seen = []
    x = torch.randn(8, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: seen.append(threading.get_ident()))
    y.sum().backward()
    assert seen and seen[0] != threading.get_ident()
    assert torch.allclose(x.grad, x.detach().exp())


def test_host_syncs_are_counted_by_kind(strict) -> None:
    side = torch.cuda.Stream()
    t = torch.arange(4.0)
    t.sum().item()
    t.tolist()
    t.cpu()
    float(t[0])
    torch.cuda.synchronize()
    side.synchronize()
    pinned = torch.empty(4, pin_memory=True)
    pinned.copy_(t)  # a blocking D2H
    pinned.copy_(t, non_blocking=True)  # not a sync
    pinned.tolist()  # host memory: not a sync
    assert dict(strict.syncs) == {"item": 2, "tolist": 1, "blocking copy": 2, "synchronize": 1,
                                  "stream.synchronize": 1}


@pytest.mark.parametrize("protect", [False, True])
def test_an_unprotected_free_lets_the_late_copy_clobber_the_next_tensor(strict, protect) -> None:
    """What a GPU does to a buffer freed while a side-stream copy still writes it: the next
    request gets the block, and the copy lands in the new tensor (record_stream keeps the
    block out of reach until the copy is done)."""
    side = torch.cuda.Stream()
    home = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True).fill_(3)
    with strict.hold(side):
        dst = torch.empty(1 << 16, dtype=torch.uint8)
        ready = torch.cuda.Event()
        ready.record()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            dst.copy_(home, non_blocking=True)
        if protect:
            dst.record_stream(side)
        del dst
        new = torch.empty(1 << 16, dtype=torch.uint8)
        new.fill_(5)  # the new owner's data, written before the copy ran
    torch.cuda.synchronize()
    if protect:
        assert strict.violations == [] and bool((new == 5).all())
    else:
        assert bool((new == 3).all())  # clobbered by the copy that was still queued
        assert len(strict.violations) == 1
        strict.violations.clear()
