"""The page store: which page lives in which tier, within byte budgets, and the traffic counters.

Residency follows :mod:`tightfit.paging.residency` (a fixed resident prefix, the rest streamed).
The store also exposes the primitives the pressure logic needs — lower or raise the device
limit (evicting or restoring pages by bytes) with an event per change.

Every byte that changes tier goes through the store's copy engine (the sweep's and a re-plan's
alike); whoever caches views of page memory registers with :meth:`PageStore.on_move`. Pages on
disk get room reserved before they are placed, and a checksum (:mod:`tightfit.paging.disk`).
Pages on the host tier (an accelerator's) are regions of pinned chunks
(:func:`tightfit.tiers.regions.pinned_pool`), pinned as asked and counted by the
:class:`~tightfit.tiers.pinned.PinnedHost` in effect when the store is made, with whatever else
pins through it (offloaded activations); the room a plan's host pages need is pinned before
any page moves, and the chunks are unlocked when the store closes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tightfit.integrity.interrupts import hold_interrupts
from tightfit.measure import tracker
from tightfit.paging import disk
from tightfit.paging.events import EventLog, PagingCounters
from tightfit.paging.layout import Page
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.residency import plan_tiers
from tightfit.paging.slab import Slab, page_runs, slabs_supported
from tightfit.tiers import pinned
from tightfit.tiers.copy import CopyEngine, CudaCopyEngine, Home
from tightfit.tiers.regions import Region, RegionPool, aligned, pinned_pool
from tightfit.tiers.spill import SpillArea


class PageStore:
    """Owns every page's bytes and decides where they live.

    Args:
        device: the params' device; state pages are updated there.
        options: the page size, the budgets and the spill folder (:class:`PagingOptions`,
            checked when it was made). ``host_budget`` is ignored on the CPU, where device
            and host are one tier.
        slabs: keep device-tier pages in slabs (one array per state name per run of pages,
            see :mod:`tightfit.paging.slab`) instead of one buffer per page. ``None``: on the
            CPU where the platform can release part of a mapping (Linux), else not.
        engine: the copy engine that moves pages (``None``: :class:`CopyEngine` on the CPU,
            :class:`CudaCopyEngine` otherwise); the store closes it.
        emulate_accelerator: for tests and emulation only: treat a CPU ``device`` as an
            accelerator's, with a separate host tier (``host_budget`` honoured, pinned buffers
            requested), one buffer per page and a :class:`CudaCopyEngine` by default, as on
            CUDA (``tests/tiers/test_copy_emulated.py`` fakes its streams and pinning).

    The store counts its pinned host bytes with :func:`tightfit.tiers.pinned.current` (the
    accountant in effect when it is made), together with everything else pinned through it.
    """

    def __init__(
        self,
        device: torch.device,
        options: PagingOptions,
        *,
        slabs: bool | None = None,
        engine: CopyEngine | None = None,
        emulate_accelerator: bool = False,
    ) -> None:
        self.device = device
        self._emulated = emulate_accelerator and device.type == "cpu"
        if slabs and (not self.on_cpu or not slabs_supported()):
            where = f"{device} (as an accelerator)" if self._emulated else str(device)
            raise ValueError(f"slabs=True needs params on the CPU of a platform with madvise "
                             f"(Linux); the params are on {where}: pass slabs=None")
        self.options = options
        self.page_bytes = options.page_bytes
        self.device_budget = options.device_budget
        self.host_budget = None if self.on_cpu else options.host_budget
        self.device_limit = options.device_budget  # lowered by pressure (see limit_device)
        # device bytes the owner's update needs besides pages and window (the optimizer's fp32
        # copies of bf16/fp16 params, a page's worth at a time): planned inside the limit
        self.scratch_bytes = 0
        self.pages: list[Page] = []
        self.spill = SpillArea(options.spill_dir)  # removes spill folders of processes that are gone
        self.events = EventLog()
        for gone in self.spill.cleaned:
            self.events.record("cleanup", f"removed the spill folder {gone.path} of process "
                               f"{gone.pid}, which no longer runs", gone.nbytes, 0, "disk", "-")
        self.counters = PagingCounters()
        self.pinned = pinned.current()
        self.engine = engine or (CopyEngine() if self.on_cpu else
                                 CudaCopyEngine(device, host=self.pinned, stream_name="pages"))
        self._host_pool: RegionPool | None = None  # the host tier's pinned chunks
        self._host_regions: dict[int, Region] = {}  # page index -> its region there
        self.slots: list[torch.Tensor] = []
        self.materialized = False
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self._spill_sizes: dict[int, int] = {}
        self.use_slabs = self.on_cpu and slabs_supported() if slabs is None else slabs
        self._slabs: dict[int, Slab] = {}  # page index -> the slab holding it on the device
        self._move_listeners: list[Callable[[], None]] = []
        self._closed = False

    @property
    def on_cpu(self) -> bool:
        """Whether device and host are one tier (the params are on the CPU, not emulating an
        accelerator): then the next tier is disk."""
        return self.device.type == "cpu" and not self._emulated

    def on_move(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` before pages move (each re-plan) and when the store closes:
        a cache of views of page memory (the optimizer's update lists) dropped there never
        keeps an evicted page's memory alive, nor a stale view."""
        self._move_listeners.append(callback)

    def _pages_moving(self) -> None:
        for callback in self._move_listeners:
            callback()

    # ------------------------------------------------------------------ layout
    def add_pages(self, pages: list[Page]) -> None:
        """Register new pages (one param group's); they are allocated by :meth:`materialize`
        (at once when it ran: then a disk without room raises ``OSError`` and nothing is added)."""
        before = len(self.pages), dict(self._spill_sizes)
        for page in pages:
            size = self._spill_sizes.get(page.group, 0)
            page.spill_offset = size
            self._spill_sizes[page.group] = size + page.nbytes
            page.tier = "new"
            self.pages.append(page)
        if self.use_slabs:
            for run in page_runs(pages):
                try:
                    slab = Slab(run)
                except OSError:  # mapping refused (e.g. strict overcommit): a buffer per page
                    continue
                self._slabs.update((page.index, slab) for page in run)
        for group, size in self._spill_sizes.items():
            self.spill.reserve(group, size)
        if self.materialized:
            try:
                self._reserve_disk(self.plan()[0])
            except BaseException:  # refused whole: the pages were only registered
                del self.pages[before[0]:]
                self._spill_sizes = before[1]
                for page in pages:
                    self._slabs.pop(page.index, None)
                raise
            self.apply_plan("param group added")

    @property
    def state_bytes(self) -> int:
        """Bytes of all pages together."""
        return sum(p.nbytes for p in self.pages)

    # ------------------------------------------------------------------ planning
    def plan(self) -> tuple[list[str], int]:
        """Target tier of every page and the number of window slots, under the current limits."""
        limit = self.device_limit
        if limit is not None and self.scratch_bytes:
            limit = max(limit - self.scratch_bytes, self.page_bytes)
        return plan_tiers(self.pages, limit, self.options, self.on_cpu)

    def materialize(self) -> None:
        """Allocate every page (zeros) in its planned tier."""
        if not self.materialized:
            self.apply_plan("initial placement")  # may refuse (no disk room): then retried
            self.materialized = True

    def _reserve_disk(self, tiers: list[str]) -> None:
        hint = "device_budget" if self.on_cpu else "device_budget or host_budget"
        disk.reserve(self.spill, [p for p, t in zip(self.pages, tiers) if t == "disk"], hint)

    def _reserve_host(self, tiers: list[str]) -> None:
        """Pin the host room the plan needs before any page moves (``TierFullError`` naming the
        budget, the room and the fix, with nothing moved): a region for every page that will be
        on the host, and for those there now (freed only as they move)."""
        if self.on_cpu:
            return
        host = [p for p, t in zip(self.pages, tiers) if "host" in (t, p.tier)]
        if host:
            pool = self._host_tier()
            pool.reserve(sum(self._region_bytes(p) for p in host))

    def _region_bytes(self, page: Page) -> int:
        """Every host page takes a region of one size, a whole page's (pages hold at most
        ``page_bytes``): chunks reserved in multiples of it never fragment, so a reserved plan
        always finds its regions (a last, smaller page wastes the rest)."""
        return max(aligned(self.page_bytes), aligned(page.nbytes))

    def _host_tier(self) -> RegionPool:
        if self._host_pool is None:
            self._host_pool = pinned_pool(aligned(self.page_bytes), None, host=self.pinned,
                                          what="optimizer host pages",
                                          device=None if self._emulated else self.device)
        return self._host_pool

    def apply_plan(self, reason: str) -> None:
        """Move pages to the tiers :meth:`plan` gives, freeing device bytes before using any.

        Disk room for the plan is reserved first (``OSError`` before any page moves), and
        Ctrl-C waits until every page is in one place (:mod:`tightfit.integrity.interrupts`).
        """
        tiers, nslots = self.plan()
        self._reserve_disk(tiers)
        self._reserve_host(tiers)
        with hold_interrupts():
            self._apply(tiers, nslots, reason)

    def _apply(self, tiers: list[str], nslots: int, reason: str) -> None:
        self.engine.synchronize()
        self._pages_moving()  # cached views of pages that may move now must go first
        moves: dict[tuple[str, str], list[int]] = {}
        # Leave the device first so the peak never exceeds the limit mid-move.
        order = sorted(range(len(self.pages)), key=lambda i: tiers[i] == "device")
        self._free_slots()  # re-made below at the size the new plan needs
        for i in order:
            page, dst = self.pages[i], tiers[i]
            src = page.tier
            if src == dst:
                continue
            copied = self._move(page, dst)
            if src != "new":
                moves.setdefault((src, dst), []).append((page.nbytes, copied))
        if nslots:
            biggest = max(p.nbytes for p in self.pages if p.tier != "device")
            self.slots = [self._alloc("device", biggest) for _ in range(nslots)]
        for (src, dst), sizes in moves.items():
            kind = "evict" if src == "device" else "restore" if dst == "device" else "move"
            # the event says how much state changed tier; the counters count bytes copied
            self.events.record(kind, reason, sum(n for n, _ in sizes), len(sizes), src, dst)
            if src == "device":
                self.counters.bytes_paged_out += sum(c for _, c in sizes)
            if dst == "device":
                self.counters.bytes_paged_in += sum(c for _, c in sizes)

    def limit_device(self, limit: int | None, reason: str) -> None:
        """Set the device limit (at most ``device_budget``) and move pages to honour it.

        This is the hook for pressure handling: lower it when activations need the room, raise
        it (up to the budget) when they are gone.
        """
        if limit is not None and limit < self.page_bytes:
            raise ValueError(
                f"device limit {limit} is below one page ({self.page_bytes} bytes); "
                "keep at least one page or lower page_bytes"
            )
        if self.device_budget is not None:
            limit = self.device_budget if limit is None else min(limit, self.device_budget)
        previous, self.device_limit = self.device_limit, limit
        if self.materialized:
            try:
                self.apply_plan(reason)
            except OSError:  # e.g. no disk room for the new plan: the old limit stands
                self.device_limit = previous
                raise

    def evict_bytes(self, nbytes: int, reason: str) -> int:
        """Move pages off the device until ``nbytes`` are freed (or one page's room is left).

        Returns:
            The device bytes actually freed (window slots included).
        """
        before = self.device_bytes
        target = max(self.page_bytes, self.device_bytes - nbytes)
        self.limit_device(target, reason)
        return before - self.device_bytes

    def restore_bytes(self, nbytes: int | None, reason: str) -> int:
        """Raise the device limit by ``nbytes`` (``None``: back to ``device_budget``).

        Returns:
            The device bytes added (pages brought back, net of window slots released).
        """
        before = self.device_bytes
        if nbytes is None or self.device_limit is None:
            self.limit_device(self.device_budget, reason)
        else:
            self.limit_device(self.device_limit + nbytes, reason)
        return self.device_bytes - before

    # ------------------------------------------------------------------ bytes
    def _count_device(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _alloc(self, tier: str, nbytes: int, page: Page | None = None) -> torch.Tensor:
        if tier == "device":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._count_device(nbytes)
            return buf
        assert page is not None  # a host page: a region of the pinned chunks
        region = self._host_tier().take(self._region_bytes(page))
        self._host_regions[page.index] = region
        self.host_bytes += nbytes
        return region.view[:nbytes]

    def _release(self, tier: str, nbytes: int, page: Page | None = None) -> None:
        if tier == "device":
            self.device_bytes -= nbytes
        elif tier == "host":
            self.host_bytes -= nbytes
            region = self._host_regions.pop(page.index, None) if page is not None else None
            if region is not None and self._host_pool is not None:
                self._host_pool.give(region)  # the copies out of it were synchronized

    def _free_slots(self) -> None:
        for slot in self.slots:
            self._release("device", slot.numel())
        self.slots = []
        self.engine.slots_freed()

    def home(self, page: Page) -> torch.Tensor | Home:
        """Where the copy engine reads and writes a non-device page: its host buffer, or
        its spill-file page (which checks the file and the checksum on the copy worker)."""
        if page.tier == "host":
            assert page.buf is not None
            return page.buf
        return disk.DiskHome(self.spill, page)

    def _move(self, page: Page, dst: str) -> int:
        """Move one page to tier ``dst``; returns the bytes copied (0 when the spill file
        already holds the page's current bytes: a clean page leaves without a write)."""
        copied = page.nbytes
        src = page.tier
        slab = self._slabs.get(page.index)
        in_slab = src == "device" and slab is not None
        # the page's current bytes: one buffer, or (in a slab) its arrays; None when new
        data: torch.Tensor | dict[str, torch.Tensor] | None
        data = None if src == "new" else self.arrays(page) if in_slab else self._buffer(page)
        new_buf = None
        if dst == "disk":
            if data is not None and page.spill_valid:
                copied = 0  # the file holds these bytes already (and their checksum)
            else:
                disk.write(self.spill, page, data, self.engine.copy)
            page.spill_valid = True
        elif dst == "device" and slab is not None:
            # fresh slab memory reads as zeros, and so does a released range
            if data is not None:
                page.copy_state(slab.views(page), data, self.engine.copy)
            self._count_device(page.nbytes)
            tracker.external_allocated((slab, page.index), page.nbytes)  # MemoryTracker sees it
        else:
            new_buf = self._alloc(dst, page.nbytes, page)
            if data is None:
                new_buf.zero_()
            else:
                page.copy_state(new_buf, data, self.engine.copy)
        if src in ("device", "host"):
            self._release(src, page.nbytes, page)
        page.buf, page.tier = new_buf, dst
        page._arrays = page._views = None  # cached views hold the old memory alive
        if in_slab:
            slab.release(page, lambda q: q.tier == "device")  # type: ignore[union-attr]
            tracker.external_freed((slab, page.index))
        return copied

    def _buffer(self, page: Page) -> torch.Tensor:
        """The one-buffer bytes of a page that is not in a slab: its buffer, or its spill
        region (checked and verified: a page leaving the disk tier is read here)."""
        return page.buf if page.buf is not None else disk.read(self.spill, page)

    def arrays(self, page: Page) -> dict[str, torch.Tensor]:
        """Typed flat views of each state array of a page in memory (device or host tier).

        They are made once and reused until the page moves, so :meth:`Page.segment_views` can
        cache the per-segment views built on them.
        """
        cached = page._arrays
        if cached is None:
            slab = self._slabs.get(page.index) if page.tier == "device" else None
            cached = slab.views(page) if slab is not None else page.array_views(page.buf)
            page._arrays = cached
        return cached

    def read_page(self, page: Page) -> torch.Tensor:
        """A CPU copy of a page's bytes in the one-buffer page format (state dicts, saving)."""
        self.engine.synchronize()
        if page.tier == "disk":
            return disk.read_copy(self.spill, page)
        if page.buf is not None:
            return page.buf.to("cpu", copy=True)
        out = torch.zeros(page.nbytes, dtype=torch.uint8)  # zeros: alignment gaps are defined
        page.copy_state(out, self.arrays(page))
        return out

    def write_page(self, page: Page, data: torch.Tensor) -> None:
        """Overwrite a page's bytes with ``data`` (a uint8 CPU tensor of ``page.nbytes``)."""
        self.engine.synchronize()
        page.spill_valid = page.tier == "disk"
        if page.tier == "disk":
            disk.write(self.spill, page, data.contiguous())
        elif page.buf is not None:
            page.buf.copy_(data)
        else:
            page.copy_state(self.arrays(page), data)

    # ------------------------------------------------------------------ reporting
    def disk_bytes(self) -> int:
        """Bytes of pages whose only copy is in a spill file."""
        return sum(p.nbytes for p in self.pages if p.tier == "disk")

    def resident_bytes(self) -> int:
        """Bytes of pages kept on the device between steps (the streaming window excluded)."""
        return sum(p.nbytes for p in self.pages if p.tier == "device")

    def host_pinned_bytes(self) -> int:
        """Host bytes the store keeps pinned: its host tier's chunks (what the host pages
        take, alignment and the room of pages since restored included)."""
        return 0 if self._host_pool is None else self._host_pool.capacity_bytes

    def stats(self) -> dict[str, Any]:
        """Bytes per tier, traffic counters, limits and event counts (the store's part of
        ``PagedOptimizer.memory_stats()``)."""
        c, counts = self.counters, self.events.counts
        return {
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
            "host_pinned_bytes": self.host_pinned_bytes(),
            "disk_bytes": self.disk_bytes(), "peak_device_bytes": self.peak_device_bytes,
            "state_bytes": self.state_bytes, "resident_bytes": self.resident_bytes(),
            "window_bytes": sum(t.numel() for t in self.slots), "scratch_bytes": self.scratch_bytes,
            "bytes_paged_in": c.bytes_paged_in, "bytes_paged_out": c.bytes_paged_out,
            "page_faults": c.page_faults, "stall_seconds": c.stall_seconds,
            "pages": len(self.pages), "page_bytes": self.page_bytes,
            "device_budget": self.device_budget, "host_budget": self.host_budget,
            "spill_dir": self.spill.folder,
            "evict_events": counts["evict"], "restore_events": counts["restore"],
        }  # fmt: skip

    def close(self) -> None:
        """Free every page and slot, stop the copy worker and delete the spill files."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
        finally:
            for page in self.pages:
                if page.tier == "device" and page.index in self._slabs:
                    tracker.external_freed((self._slabs[page.index], page.index))
                page.buf = None
                page._arrays = page._views = None
                page.tier = "closed"
            self.slots = []
            self._pages_moving()
            for slab in dict.fromkeys(self._slabs.values()):
                slab.close()
            self._slabs = {}
            self.device_bytes = self.host_bytes = 0
            self._host_regions.clear()
            try:
                if self._host_pool is not None:
                    self._host_pool.close()  # unlocks the pinned chunks (the engine is done)
            finally:
                self._host_pool = None
                self.spill.close()
