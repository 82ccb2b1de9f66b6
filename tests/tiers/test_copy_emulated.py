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

import threading
import time

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.tiers.copy import CudaCopyEngine
from tightfit.tiers.copy_queue import CopyQueue

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


class _Recording:
    """A spill-file-like home (host bytes, read and written by the engine's queue) that
    records the thread of each read and write."""

    def __init__(self, nbytes: int, fill: int = 0) -> None:
        self.bytes = torch.frombuffer(bytearray([fill]) * nbytes, dtype=torch.uint8)  # not device
        self.threads: list[int] = []

    def read_into(self, dst: torch.Tensor) -> None:
        self.threads.append(threading.get_ident())
        dst.copy_(self.bytes)

    def write_from(self, src: torch.Tensor) -> None:
        self.threads.append(threading.get_ident())
        self.bytes.copy_(src)


def test_staged_copies_run_on_the_worker_never_on_the_stepping_thread(strict_cuda) -> None:
    """A staged write-back waits for its device-to-host copy (an event synchronize) before it
    writes the home: run by the stepping thread, that is a host sync per page on disk. Before,
    a thread that waited for the queue ran the queued copies itself whenever the worker had
    not woken yet (3 runs of this test on it: 0-4 event synchronizes of the 8 write-backs, as
    the threads were scheduled, and copies on the test's thread each time)."""
    engine = CudaCopyEngine(torch.device("cuda", 0))
    slot = torch.empty(4096, dtype=torch.uint8)  # device memory (the emulation's)
    slot.fill_(7)
    first = _Recording(4096)
    try:
        engine.store(slot, first)
        engine.drain()  # the worker is started
        time.sleep(0.05)  # and idle: a waiter that helps the queue would find the copies first
        homes = [_Recording(4096) for _ in range(8)]
        before = strict_cuda.sync_count()
        for home in homes:
            engine.store(slot, home)
        engine.drain()
        source = _Recording(4096, fill=3)
        stall = engine.wait(engine.load(source, slot))  # a staged load: the read, then H2D
        assert strict_cuda.sync_count() == before, dict(strict_cuda.syncs)
        assert stall >= 0.0
        main = threading.get_ident()
        assert all(t != main for h in [first, *homes, source] for t in h.threads)
        assert all(bool((h.bytes == 7).all()) for h in homes)
        engine.synchronize()
        assert bool((slot == 3).all())
    finally:
        engine.close()


def test_a_queue_without_helpers_runs_on_the_waiter_once_its_worker_stopped() -> None:
    queue = CopyQueue(help_waiters=False)
    ran: list[int] = []
    queue.submit(lambda: ran.append(threading.get_ident())).result()
    queue.close()  # the worker has stopped: a later copy must not wait for it for ever
    queue.submit(lambda: ran.append(threading.get_ident())).result()
    assert ran[0] != threading.get_ident() and ran[1] == threading.get_ident()
