"""Regions of the next tier, handed out and taken back: offloaded activations' homes.

A :class:`RegionPool` cuts *chunks* of a tier — a spill file reserved on disk (the next tier
when the device is the CPU) or a pinned host buffer (when it is CUDA) — into page-aligned
regions, first fit, and coalesces them when they come back. A training step offloads the same
tensors every step and takes every region back before the next, so after the first step the
pool never grows: no allocation of host buffers per step. A tier that runs out of room raises
:class:`TierFullError`, naming the tier, the place and the bytes, before anything is written.

Pinned chunks come from :mod:`tightfit.tiers.pinned`: exactly the bytes asked (whole pages,
no power-of-two rounding), counted with the other pinned users against one budget, and
unlocked when the pool closes. The page store's host tier is such a pool too.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tightfit.tiers import pinned
from tightfit.tiers.copy import CopyEngine
from tightfit.tiers.pinned import PinnedBuffer, PinnedHost, TierFullError
from tightfit.tiers.spill import SpillArea, release_range

PAGE = mmap.PAGESIZE
__all__ = ["PAGE", "Region", "RegionPool", "TierFullError", "aligned", "disk_pool",
           "measure_tier", "pinned_pool", "tier_capacity"]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a region of that size takes)."""
    return -(-nbytes // PAGE) * PAGE


@dataclass
class Region:
    """``view``: ``nbytes`` (uint8) at ``offset`` of chunk ``chunk``, page aligned."""

    chunk: int
    offset: int
    size: int  # page-rounded bytes taken from the chunk
    view: torch.Tensor


class RegionPool:
    """Page-aligned regions of a tier's chunks, reused across steps.

    Args:
        tier: ``"disk"`` or ``"host"``, for messages.
        make_chunk: ``make_chunk(index, nbytes)`` → a uint8 tensor of ``nbytes`` (raises
            :class:`TierFullError` when the tier cannot hold it).
        grow_bytes: Size of the first chunk (the plan's predicted host bytes), at least.
        limit_bytes: Most bytes the pool may take on the tier (the host budget), or ``None``.
        where: The place, for messages (the spill folder, "pinned host memory").
        free_chunk: ``free_chunk(index)`` gives chunk ``index`` back to its tier when the
            pool closes (``None``: the chunk's owner frees it, as the spill area does).
        growth: A chunk after the first is at least this share of the first (fewer, larger
            chunks when a plan underestimated); 0: exactly what the region needs.
    """

    def __init__(self, tier: str, make_chunk: Callable[[int, int], torch.Tensor],
                 grow_bytes: int, limit_bytes: int | None, where: str,
                 free_chunk: Callable[[int], None] | None = None, growth: float = 0.25) -> None:
        self.tier, self.where = tier, where
        self._make, self._free_chunk, self._growth = make_chunk, free_chunk, growth
        self._grow = aligned(max(grow_bytes, PAGE))
        self.limit_bytes = limit_bytes
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (offset, size)
        self._lock = threading.Lock()
        self.chunks_made = 0
        self.used_bytes = 0
        self.peak_used_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all chunks made."""
        return sum(c.numel() for c in self._chunks)

    def take(self, nbytes: int) -> Region:
        """A region of at least ``nbytes``; a new chunk when none has room.

        Raises:
            TierFullError: The host budget or the tier itself cannot hold another chunk.
        """
        size = aligned(max(nbytes, 1))
        with self._lock:
            for c, free in enumerate(self._free):
                for k, (off, n) in enumerate(free):
                    if n >= size:
                        free[k:k + 1] = [(off + size, n - size)] if n > size else []
                        return self._handed(c, off, size, nbytes)
            c = self._new_chunk(size)
            if size < self._chunks[c].numel():
                self._free[c].append((size, self._chunks[c].numel() - size))
            return self._handed(c, 0, size, nbytes)

    def _new_chunk(self, size: int, exact: bool = False) -> int:
        chunk = size if exact else max(size, self._grow if not self._chunks else
                                       aligned(int(self._grow * self._growth)))
        if self.limit_bytes is not None and self.capacity_bytes + chunk > self.limit_bytes:
            chunk = size  # a smaller chunk may still fit the budget
            if self.capacity_bytes + chunk > self.limit_bytes:
                raise TierFullError(
                    errno.ENOSPC,
                    f"offload tier '{self.tier}' ({self.where}): {size} more bytes would pass "
                    f"its budget of {self.limit_bytes} bytes ({self.capacity_bytes} in use). "
                    "Raise host_budget, or lower the device budget's need for offload; the "
                    "step can be rerun")
        self._chunks.append(self._make(len(self._chunks), chunk))
        self._free.append([])
        self.chunks_made += 1
        return len(self._chunks) - 1

    def _handed(self, chunk: int, offset: int, size: int, nbytes: int) -> Region:
        self.used_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return Region(chunk, offset, size, self._chunks[chunk][offset:offset + nbytes])

    def give(self, region: Region) -> None:
        """Take ``region`` back (its bytes may be overwritten from now on)."""
        with self._lock:
            if region.chunk >= len(self._free):
                return  # the pool was closed since
            self.used_bytes -= region.size
            free = self._free[region.chunk]
            free.append((region.offset, region.size))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, n in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            free[:] = merged

    def covering(self, regions: list[Region]) -> list[torch.Tensor]:
        """Per chunk, one view from the first to the end of the last of ``regions`` (whole
        pages): what one release call hands back for all of them."""
        spans: dict[int, tuple[int, int]] = {}
        for r in regions:
            lo, hi = spans.get(r.chunk, (r.offset, r.offset + r.size))
            spans[r.chunk] = (min(lo, r.offset), max(hi, r.offset + r.size))
        with self._lock:
            return [self._chunks[c][lo:hi] for c, (lo, hi) in spans.items()
                    if c < len(self._chunks)]

    def reserve(self, nbytes: int) -> None:
        """Grow the pool to hold at least ``nbytes`` in all (one new chunk of what is missing).

        Raises:
            TierFullError: The budget or the tier cannot hold it (nothing was added).
        """
        with self._lock:
            missing = aligned(nbytes) - self.capacity_bytes
            if missing > 0:
                self._new_chunk(missing, exact=True)
                self._free[-1].append((0, missing))

    def close(self) -> None:
        """Forget every chunk and give each back to its tier (``free_chunk``; a spill
        area's chunks go with its close). Every copy that used them must be done."""
        with self._lock:
            count = len(self._chunks)
            self._chunks.clear()
            self._free.clear()
            self.used_bytes = 0
        if self._free_chunk is not None:
            for index in range(count):
                self._free_chunk(index)


def disk_pool(spill: SpillArea, grow_bytes: int, limit_bytes: int | None) -> RegionPool:
    """Regions of spill files reserved on disk whole (``SpillArea.allocate``)."""

    def make(index: int, nbytes: int) -> torch.Tensor:
        try:
            return spill.allocate(index, nbytes)
        except OSError as exc:
            raise TierFullError(
                errno.ENOSPC,
                f"offload tier 'disk' (spill folder {spill.location}) has no room for {nbytes} "
                f"bytes of offloaded activations ({_free_disk(spill.location)} bytes free; "
                f"{exc.strerror or exc}). Free space there or pass spill_dir= a folder with "
                "room; the step can be rerun") from exc

    return RegionPool("disk", make, grow_bytes, limit_bytes, spill.location)


def pinned_pool(grow_bytes: int, limit_bytes: int | None, *, host: PinnedHost | None = None,
                what: str = "offloaded activations",
                device: torch.device | None = None) -> RegionPool:
    """Regions of pinned host buffers (the next tier of a CUDA device), pinned through
    ``host`` (``None``: :func:`tightfit.tiers.pinned.current`) and unlocked on close.

    Args:
        grow_bytes: The first chunk (the bytes the plan predicts): pinned as asked, whole.
        limit_bytes: Most bytes this pool may pin (its own budget), or ``None``.
        host: The accountant shared with the other pinned users.
        what: Who the bytes are for, in messages and ``host.stats()``.
        device: The CUDA device whose copies use the chunks (synchronized before unlocking).
    """
    host = host if host is not None else pinned.current()
    buffers: dict[int, PinnedBuffer] = {}

    def make(index: int, nbytes: int) -> torch.Tensor:
        buffers[index] = host.pin(nbytes, what, device)  # TierFullError names the room
        return buffers[index].tensor

    def free(index: int) -> None:
        buffers.pop(index).release()

    # growth 0: a region the plan did not foresee pins what it needs, not a quarter more
    # of the plan (locked memory the OS cannot reclaim)
    return RegionPool("host", make, grow_bytes, limit_bytes, "pinned host memory", free,
                      growth=0.0)


def _free_disk(folder: str | None) -> int:
    try:
        return shutil.disk_usage(folder or tempfile.gettempdir()).free
    except OSError:
        return 0


def tier_capacity(tier: str, spill_dir: str | os.PathLike | None = None) -> int:
    """Bytes the next tier can take now: free disk of the spill folder, or host RAM to pin
    (:meth:`tightfit.tiers.pinned.PinnedHost.room` of the accountant in effect: its budget
    left, within ``MemAvailable``, the memory cgroup's room and, on WSL, half the RAM)."""
    if tier == "disk":
        return _free_disk(None if spill_dir is None else str(spill_dir))
    return pinned.current().room()


def measure_tier(engine: CopyEngine, pool: RegionPool, device: torch.device,
                 nbytes: int = 8 << 20) -> tuple[float, float]:
    """``(bandwidth, latency)`` of one-way moves through ``engine`` to ``pool``'s tier.

    Round trips of 4 KiB (the latency: best of three) and of ``nbytes`` (the bandwidth, net
    of the latency), as an offloaded activation pays them: the write out (on the disk tier:
    to the page cache, then ``msync`` and ``MADV_DONTNEED``, so the bytes really leave RAM)
    and the read back.
    """
    small = min(_round_trip(engine, pool, device, PAGE) for _ in range(3)) / 2
    big = _round_trip(engine, pool, device, nbytes) / 2
    return nbytes / max(big - small, 1e-9), small


def _round_trip(engine: CopyEngine, pool: RegionPool, device: torch.device,
                nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    region = pool.take(nbytes)

    def release() -> None:
        if pool.tier == "disk":
            release_range(region.view)

    try:
        _sync(device)
        t0 = time.perf_counter()
        engine.retire(engine.offload(src, region.view))
        engine.then(release).result()
        engine.wait(engine.fetch(region.view, dst))
        engine.then(release).result()
        _sync(device)
        return time.perf_counter() - t0
    finally:
        pool.give(region)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
