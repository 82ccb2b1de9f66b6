"""Probes: how many bytes of a memory tier are in use right now, and how many it can hold.

The pager keeps the device tier under a target occupancy; a probe is how it sees the real
usage, including memory it does not own (activations, gradients, other libraries):

- :class:`CudaProbe` — a CUDA device, from the driver (``torch.cuda.mem_get_info``) and the
  caching allocator: its whole free segments are headroom (torch reuses them without asking
  the driver), the holes in split segments are not; capacity is capped by the per-process
  memory fraction.
- :class:`CgroupProbe` — the CPU under a memory cgroup with a limit: what the cgroup charges
  less its page cache, against that limit (the CPU's default there).
- :class:`RSSProbe` — the CPU, as this process's resident set size (psutil). Its capacity is
  what the user says, else the memory cgroup's limit when the process runs under one.

Every probe remembers the highest usage it has reported (``peak_bytes``) and how many
readings it took (``reads``), so a test can assert "never above the target" and a benchmark
can count what watching cost.
"""

from __future__ import annotations

import os
import sys
import weakref
from abc import ABC, abstractmethod
from pathlib import Path

import psutil
import torch

from tightfit.measure.cgroup import MemoryCgroup, limiting_cgroup, stat_value
from tightfit.pressure.highwater import rss_high_water

__all__ = ["CgroupProbe", "CudaProbe", "Probe", "RSSProbe", "cgroup_memory_limit"]


class Probe(ABC):
    """Reads the used bytes of one memory tier; remembers the peak of its readings.

    Subclasses implement :meth:`_used_bytes` and :meth:`capacity_bytes`.

    Attributes:
        device: The device whose memory this probe reads.
        reads: Number of readings taken since construction or :meth:`reset_peak`.
    """

    device: torch.device

    def __init__(self) -> None:
        self._peak = 0
        self.reads = 0

    @abstractmethod
    def _used_bytes(self) -> int:
        """Bytes in use now, as this probe defines usage."""

    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Bytes the tier can hold, or ``None`` when unknown (then a target must be in bytes)."""

    def used_bytes(self) -> int:
        """Read the current usage in bytes (and fold it into :attr:`peak_bytes`)."""
        used = int(self._used_bytes())
        self.reads += 1
        if used > self._peak:
            self._peak = used
        return used

    @property
    def peak_bytes(self) -> int:
        """Highest usage any reading has returned since construction or :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        """Forget the peak and the reading count (e.g. between warm-up and measurement)."""
        self._peak = 0
        self.reads = 0

    def interval_peak_bytes(self) -> int | None:
        """Highest usage since the previous call, where the probe can know it between readings.

        Readings are samples; a transient between two of them (a block's temporaries) is only
        visible through a high-water mark. Probes with one (RSS, the CUDA allocator) return it
        when it rose since the previous call — a new high set in between — and ``None``
        otherwise, as do probes without one. Nothing is reset, so other users of the
        high-water mark (``wait4``, ``max_memory_allocated``) are not disturbed.
        """
        return None

    def headroom_bytes(self, limit_bytes: int) -> int:
        """``limit_bytes`` minus the current usage (negative when over the limit)."""
        return int(limit_bytes) - self.used_bytes()

    def __repr__(self) -> str:
        cap = self.capacity_bytes()
        cap_s = "unknown" if cap is None else f"{cap / 2**20:.1f} MiB"
        return f"{type(self).__name__}(device={self.device}, capacity={cap_s})"


class CudaProbe(Probe):
    """Usage of a CUDA device: what is not available to a new tensor of this process.

    ``capacity`` is the device's total, capped by ``torch.cuda.get_per_process_memory_fraction``
    (the caching allocator refuses to reserve past ``fraction * total``; the default 1.0 is no
    cap). ``used = capacity - room``, where a new tensor's room is

    - the driver's free bytes (``mem_get_info``, every process and context counted), within
      what the fraction still lets this process reserve (``fraction * total - reserved``), plus
    - the caching allocator's reserved-but-unallocated bytes **in whole free segments only**:
      torch reuses or releases those for a request of any size. The free holes inside split
      segments (``inactive_split_bytes`` of ``memory_stats``) are not room: evicted 8 MiB pages
      leave them inside 20 MiB segments and a large activation cannot use them, so counting them
      would show room where the allocator would raise OOM. Without that statistic (another
      allocator backend) no cached byte counts as room.

    So ``used = allocated + split holes + max(0, capacity - free - reserved)`` (the last term:
    what others hold of this process's share). A cache that grew during a spike and is now
    free, whole, does not look like pressure after it.

    Args:
        device: A CUDA device (``"cuda"``, ``"cuda:1"``, an index). ``None`` is the current one.

    Raises:
        ValueError: ``device`` is not a CUDA device, or CUDA is not available.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise ValueError(
                "CudaProbe needs a CUDA device and none is available; on the CPU use "
                "RSSProbe(capacity_bytes=...)."
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaProbe reads a CUDA device, got {device}; use RSSProbe on the CPU.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        _, self._total = torch.cuda.mem_get_info(device)
        self._last_max = int(torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0))

    def capacity_bytes(self) -> int:
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        cap = float(fraction(self.device)) if callable(fraction) else 1.0
        return min(int(self._total), int(cap * self._total))

    def _others(self, stats: dict) -> int:
        """What others hold of this process's share: ``max(0, capacity - free - reserved)``."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, self.capacity_bytes() - int(free) - int(stats.get("reserved_bytes.all.current", 0)))

    @staticmethod
    def _holes(stats: dict) -> int:
        """Reserved-but-unallocated bytes a large request cannot use (see the class docstring)."""
        split = stats.get("inactive_split_bytes.all.current")
        if split is None:  # no such statistic: count every cached byte as used
            return int(stats.get("reserved_bytes.all.current", 0)) - int(
                stats.get("allocated_bytes.all.current", 0))
        return int(split)

    def _used_bytes(self) -> int:
        stats = torch.cuda.memory_stats(self.device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        return self._others(stats) + allocated + self._holes(stats)

    def interval_peak_bytes(self) -> int | None:
        """The allocator's peak since the previous call, in :meth:`used_bytes`'s terms.

        ``max_memory_allocated`` only falls when someone resets it (``MemoryTracker`` does,
        every ``track_every`` steps), and a reset after the previous call makes everything
        it has seen since part of this interval. So a peak that differs from the one the
        previous call saw is new: higher, or after a reset. The same peak is ``None``.
        """
        stats = torch.cuda.memory_stats(self.device)
        top = int(stats.get("allocated_bytes.all.peak", 0))
        if top == self._last_max:
            return None
        self._last_max = top
        return self._others(stats) + top + self._holes(stats)

    def allocator_peak_bytes(self) -> int:
        """Peak of the caching allocator (``max_memory_allocated``) plus today's non-torch usage.

        Readings are samples; the allocator's own statistic sees every allocation, so this is
        the bound to assert against after a region of code (reset it with
        ``torch.cuda.reset_peak_memory_stats``).
        """
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        non_torch = total - free - reserved
        return int(non_torch + torch.cuda.max_memory_allocated(self.device))


class RSSProbe(Probe):
    """Usage of the CPU: this process's resident set size.

    Args:
        capacity_bytes: The memory the process may use, in bytes. ``None`` takes the memory
            cgroup's limit when the process runs under one (see :func:`cgroup_memory_limit`),
            else the capacity stays unknown and a pager target must be given in bytes.

    Raises:
        ValueError: ``capacity_bytes`` is not positive.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        super().__init__()
        if capacity_bytes is not None and int(capacity_bytes) <= 0:
            raise ValueError(
                f"RSSProbe capacity_bytes must be positive, got {capacity_bytes}; pass the "
                "memory the process may use in bytes, or None to use the cgroup limit."
            )
        self.device = torch.device("cpu")
        self._capacity = int(capacity_bytes) if capacity_bytes is not None else cgroup_memory_limit()
        # /proc/self/statm is what psutil reads on Linux; reading it ourselves skips psutil's
        # per-call overhead. Other systems go through psutil.
        self._statm = Path("/proc/self/statm") if sys.platform.startswith("linux") else None
        self._page = os.sysconf("SC_PAGE_SIZE") if self._statm is not None else 1
        self._proc = None
        self._last_hwm = self.process_peak_bytes()
        if self._statm is None:
            self._proc = psutil.Process()

    def capacity_bytes(self) -> int | None:
        return self._capacity

    def _used_bytes(self) -> int:
        if self._statm is not None:
            with open(self._statm, "rb") as f:
                return int(f.read().split()[1]) * self._page
        return int(self._proc.memory_info().rss)

    def interval_peak_bytes(self) -> int | None:
        hwm = self.process_peak_bytes()
        if hwm <= self._last_hwm:
            return None
        self._last_hwm = hwm
        return hwm

    @staticmethod
    def process_peak_bytes() -> int:
        """The operating system's high-water mark of this process's RSS (whole lifetime)."""
        return rss_high_water()


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup in bytes, or ``None`` when it has none.

    The smallest limit along the process's cgroup path, v1 or v2
    (:func:`~tightfit.measure.cgroup.limiting_cgroup`).
    """
    cg = limiting_cgroup()
    return None if cg is None else cg.limit


class CgroupProbe(Probe):
    """Usage of the CPU as the memory cgroup that limits this process charges it, less page
    cache.

    ``used = charge - (inactive_file + active_file)``: anonymous and shared memory and the
    kernel's charged objects, of every process in the cgroup. The page cache on the LRU lists
    (the model file, the spill file, libraries) is left out: the kernel reclaims it before it
    kills at the limit, and it fills whatever room the limit leaves, so the charge itself sits
    at the limit under a cap whatever the run needs. RSS is not it either: it counts mapped
    library pages another cgroup was charged for. Measured, ``benchmarks/spike_cli.md``: the
    run the kernel killed reached 845 MiB anonymous, 854 MiB charged, at an 854 MiB cap; an
    uncapped run peaked at 889 MiB by this figure, 886 MiB anonymous, 1,046 MiB RSS and
    1,260 MiB charged.

    A reading is two ``pread`` calls on files kept open (the charge, ``memory.stat``) and one
    on ``/proc/self/statm`` (for :meth:`interval_peak_bytes`): about 20 µs on a small VM.

    Args:
        cgroup: The cgroup to read; ``None`` finds the one with the smallest limit on this
            process's path (:func:`~tightfit.measure.cgroup.limiting_cgroup`).
        capacity_bytes: Overrides the cgroup's limit as the capacity (needed for a cgroup
            without a limit).

    Raises:
        ValueError: no cgroup with a limit was found and none was given, or no capacity.
    """

    def __init__(self, cgroup: MemoryCgroup | None = None, capacity_bytes: int | None = None) -> None:
        super().__init__()
        cgroup = cgroup if cgroup is not None else limiting_cgroup()
        if cgroup is None:
            raise ValueError("CgroupProbe: this process runs under no memory cgroup with a "
                             "limit; use RSSProbe(capacity_bytes=...) instead.")
        capacity = capacity_bytes if capacity_bytes is not None else cgroup.limit
        if capacity is None or int(capacity) <= 0:
            raise ValueError(f"CgroupProbe needs a positive capacity: {cgroup.path} has no "
                             f"limit and capacity_bytes={capacity_bytes}.")
        self.device = torch.device("cpu")
        self.cgroup = cgroup
        self._capacity = int(capacity)
        self._keys = cgroup.file_keys
        # kept open: a reading is then a pread each (~2 µs charge, ~15 µs memory.stat), not
        # an open/read/close (~25 µs and ~55 µs)
        self._fds = [os.open(f, os.O_RDONLY) for f in (cgroup.charge_file, cgroup.stat_file,
                                                      "/proc/self/statm")]
        self._closer = weakref.finalize(self, _close_all, self._fds)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._last_hwm = RSSProbe.process_peak_bytes()
        self._now = (0, 0)  # (used, RSS) of the latest reading

    def capacity_bytes(self) -> int:
        return self._capacity

    def _used_bytes(self) -> int:
        charge_fd, stat_fd, statm_fd = self._fds
        charge = int(os.pread(charge_fd, 64, 0))
        stat = os.pread(stat_fd, 1 << 16, 0)
        cache = sum(stat_value(stat, k) for k in self._keys)
        rss = int(os.pread(statm_fd, 128, 0).split()[1]) * self._page
        self._now = (charge - cache, rss)
        return charge - cache

    def interval_peak_bytes(self) -> int | None:
        """The latest reading plus how far this process's RSS high-water mark rose above its
        RSS at that reading, when it set a new high: the cgroup keeps no high-water mark of
        this figure (``max_usage_in_bytes`` counts page cache), and a block's temporaries
        are anonymous memory, which RSS and the charge both count."""
        hwm = RSSProbe.process_peak_bytes()
        if hwm <= self._last_hwm:
            return None
        self._last_hwm = hwm
        used, rss = self._now
        return used + max(hwm - rss, 0)

    def close(self) -> None:
        """Close the files the probe keeps open (also done when it is collected)."""
        self._closer()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()
