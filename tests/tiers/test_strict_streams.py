"""CUDA's copy engine and the activation offload under the strict stream emulation
(``tests/tiers/strict_cuda.py``): every cross-stream use ordered, and every device tensor a
side stream used protected from the caching allocator when it is freed (issue 25, findings 4
and 5).
"""

from __future__ import annotations

import gc

import pytest
import torch

from tightfit.checkpoint.offload import Offloader
from tightfit.checkpoint.plan import OffloadTier
from tightfit.optim.adamw import PagedAdamW
from tightfit.tiers.copy import CudaCopyEngine

from .counting import CountingCudaEngine, count_copies
from .strict_cuda import StrictCuda, install, uninstall

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def strict(monkeypatch) -> StrictCuda:  # noqa: ANN001
    emu = install(monkeypatch)
    yield emu
    uninstall(emu)


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
