"""The one place tightfit pins host memory: buffers it registers itself, counted as pinned,
within one host budget and what the machine (and its memory cgroup) lets it pin.

Why not torch's pinned allocator (``torch.empty(..., pin_memory=True)``). torch 2.13's
``CachingHostAllocator`` (``ATen/core/CachingHostAllocator.h``) rounds every request up to a
power of two (``PowerOf2Ceil``; ``pinned_max_round_threshold`` and ``pinned_max_cached_size``
default to ``SIZE_MAX``), so 17 GiB asked is 32 GiB pinned, and a freed block stays pinned in
its cache until ``torch.accelerator.empty_host_cache()``, which frees every idle pinned block
of the process (other code's too) through ``cudaFreeHost``, itself a device-wide sync. A
budget counted on the requested sizes then passes by up to 2x, and a closed pool gives nothing
back to the OS.

So tightfit pins its own memory: an anonymous private ``mmap`` (whole OS pages, unmapped when
its last view goes), page-locked with ``cudaHostRegister`` (``torch.cuda.cudart()``, public in
torch 2.13; the portable flag, so every context sees it as pinned). What is pinned is what was
asked, to the page; :meth:`PinnedHost.release` unregisters it at once, after a device sync —
torch's allocator would have kept the block behind events recorded for the copies that used
it; here no copy on any stream may still run when the pages are unlocked. Registered memory is
page-locked host memory to CUDA (``cudaPointerGetAttributes`` says ``cudaMemoryTypeHost``), so
``is_pinned()`` is true and ``non_blocking`` copies from and to it are asynchronous, as from
torch's blocks.

One :class:`PinnedHost` counts everything its users pin — the offloaded activations' pool
(:func:`tightfit.tiers.regions.pinned_pool`), the paged optimizer's host pages
(:class:`tightfit.paging.store.PageStore`), the copy engine's staging buffers — against one
``budget`` and the machine's room (:func:`host_room`: ``MemAvailable``, the memory cgroup's
room, half the RAM on WSL). Users take the accountant in effect when they are made
(:func:`current`); ``with sharing(PinnedHost(budget)):`` around building a model and its
optimizer gives both one budget (``tightfit train`` does).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from tightfit.measure import tracker
from tightfit.measure.cgroup import cgroup_room, limiting_cgroup

PAGE = mmap.PAGESIZE
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


class TierFullError(OSError):
    """The next tier has no room for bytes asked of it; free space there and rerun the step."""


def pinned_size(nbytes: int) -> int:
    """Bytes pinning ``nbytes`` here takes: whole OS pages."""
    return -(-max(int(nbytes), 1) // PAGE) * PAGE


def torch_pinned_size(nbytes: int) -> int:
    """Bytes torch 2.13's caching host allocator pins for a request of ``nbytes`` with its
    default settings: the next power of two (what tightfit pinned before; for comparisons)."""
    return 1 << (max(int(nbytes), 1) - 1).bit_length()


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{}`` where there is none: not Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def host_room() -> tuple[int, str]:
    """``(bytes, what bounds them)``: how much more host memory may be pinned now.

    Pinned pages can be neither reclaimed nor swapped, so the bound is what is free
    (``MemAvailable``), within the room the memory cgroup limiting this process leaves
    (``limit - (charge - page cache)``: :func:`tightfit.measure.cgroup.cgroup_room`), and on
    WSL half the RAM (CUDA's pinned-memory limit there).
    """
    info = meminfo()
    avail = info.get("MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 0
    room, bound = int(avail), "MemAvailable"
    wsl = "microsoft" in _kernel_release().lower() and "MemTotal" in info
    if wsl and info["MemTotal"] // 2 < room:
        room, bound = info["MemTotal"] // 2, "half the RAM (WSL's pinned limit)"
    cg = cgroup_room()
    if cg is not None and cg < room:
        where = limiting_cgroup()
        room, bound = cg, f"the memory cgroup {where.path if where else ''}'s limit"
    return room, bound


def _kernel_release() -> str:
    return os.uname().release if hasattr(os, "uname") and sys.platform != "win32" else ""


@dataclass(eq=False)
class PinnedBuffer:
    """``nbytes`` of pinned host memory (``tensor``, uint8), ``pinned_bytes`` of it locked.

    Attributes:
        tensor: The bytes asked for (a view of the page-locked mapping).
        nbytes: Bytes asked for.
        pinned_bytes: Bytes locked (whole pages).
        what: Who it is for (messages and :meth:`PinnedHost.stats`).
        device: The CUDA device whose copies use it (synchronized before it is unlocked).
    """

    tensor: torch.Tensor
    nbytes: int
    pinned_bytes: int
    what: str
    device: torch.device | None
    owner: PinnedHost
    _map: mmap.mmap | None = None

    def release(self) -> None:
        """Unlock and free it (see :meth:`PinnedHost.release`)."""
        self.owner.release(self)


class PinnedHost:
    """Counts the host bytes its users pin, rounding included, against one budget.

    Args:
        budget: Most bytes all of its users may pin together (``None``: only the machine's
            room, :func:`host_room`, bounds them).
    """

    def __init__(self, budget: int | None = None) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"the pinned host budget must be a number of bytes >= 0 or None, "
                             f"got {budget!r}; e.g. 32 << 30 for 32 GiB.")
        self.budget = budget
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self.requested_bytes = 0
        self.by_user: dict[str, int] = {}
        self._live: set[PinnedBuffer] = set()
        self._lock = threading.Lock()

    def room(self) -> int:
        """Bytes that may still be pinned: the budget left, within the machine's room."""
        machine, _ = host_room()
        if self.budget is None:
            return machine
        return max(0, min(machine, self.budget - self.pinned_bytes))

    def pin(self, nbytes: int, what: str, device: torch.device | None = None) -> PinnedBuffer:
        """``nbytes`` of page-locked host memory for ``what``, counted before it is made.

        Raises:
            TierFullError: It would pass the budget, or the machine cannot pin it now
                (nothing was pinned then).
        """
        size = pinned_size(nbytes)
        with self._lock:
            self._check(size, what)
            self._count(size, nbytes, what)  # held while pinning: two users cannot both fit
        try:
            mapping, tensor = _locked_mapping(size, what)
        except BaseException:
            with self._lock:
                self._count(-size, -nbytes, what)
            raise
        buf = PinnedBuffer(tensor[:nbytes], int(nbytes), size, what, device, self, mapping)
        with self._lock:
            self._live.add(buf)
        return buf

    def _check(self, size: int, what: str) -> None:
        users = ", ".join(f"{k} {v}" for k, v in self.by_user.items() if v) or "nothing"
        if self.budget is not None and self.pinned_bytes + size > self.budget:
            raise TierFullError(
                errno.ENOMEM,
                f"pinned host memory: {size} more bytes for {what} would pass the host budget of "
                f"{self.budget} bytes ({self.pinned_bytes} pinned: {users}). Raise that budget "
                "(PinnedHost(budget=...) given to tiers.pinned.sharing; tightfit train shares "
                "the pinned fraction of the host's RAM that tightfit plan checks), or keep less "
                "on the host (a larger --device-budget, --offload none, more "
                "--resident-layers); the step can be rerun")
        machine, bound = host_room()
        if size > machine:
            raise TierFullError(
                errno.ENOMEM,
                f"pinned host memory: {size} more bytes for {what} cannot be pinned: "
                f"{machine} bytes can be now ({bound}; {self.pinned_bytes} pinned by tightfit: "
                f"{users}). Free host memory, raise the limit, or lower host_budget so that less "
                "is kept on the host; the step can be rerun")

    def _count(self, size: int, nbytes: int, what: str) -> None:
        self.pinned_bytes += size
        self.requested_bytes += nbytes
        self.by_user[what] = self.by_user.get(what, 0) + size
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    def release(self, buf: PinnedBuffer) -> None:
        """Unlock ``buf``'s pages and give them back to the OS (a second call does nothing).

        The device is synchronized first: a copy still queued on any stream must land before
        its pages are unlocked. Views of the buffer that outlive it read and write plain
        (pageable) memory from then on; the mapping goes when the last of them does.
        """
        with self._lock:
            if buf not in self._live:
                return
            self._live.discard(buf)
        try:
            if buf.device is not None and buf.device.type == "cuda":
                torch.cuda.synchronize(buf.device)
            else:
                torch.cuda.synchronize()
            _unlock(buf.tensor)
        finally:
            with self._lock:
                self._count(-buf.pinned_bytes, -buf.nbytes, buf.what)
            # the mapping is unmapped when its last view goes (torch.frombuffer's tensors
            # hold the mmap object; closing it here would leave live views dangling)
            buf._map = None
            buf.tensor = torch.empty(0, dtype=torch.uint8)

    def stats(self) -> dict[str, object]:
        """``pinned_bytes`` (locked now), ``requested_bytes`` (asked for, of those),
        ``peak_pinned_bytes``, ``budget``, ``buffers`` and the pinned bytes per user."""
        with self._lock:
            return {"pinned_bytes": self.pinned_bytes, "requested_bytes": self.requested_bytes,
                    "peak_pinned_bytes": self.peak_pinned_bytes, "budget": self.budget,
                    "buffers": len(self._live), "by_user": dict(self.by_user)}


def _locked_mapping(size: int, what: str) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous private mapping of ``size`` bytes, page-locked for CUDA."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    with tracker.not_counted():  # the host tier, not memory a step allocates on the device
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(tensor.data_ptr(), size, _PORTABLE)
    if err != rt.cudaError.success:
        reason = rt.cudaGetErrorString(err)
        _consume_cuda_error()
        del tensor
        mapping.close()
        raise TierFullError(
            errno.ENOMEM,
            f"pinned host memory: cudaHostRegister could not lock {size} bytes for {what} "
            f"({reason}). Free host memory or lower host_budget; the step can be rerun")
    return mapping, tensor


def _consume_cuda_error() -> None:
    # A failed runtime call stays the thread's "last error", which torch's next kernel-launch
    # check (cudaGetLastError) would report as that kernel's failure; a one-element kernel
    # launch here reads and clears it.
    with contextlib.suppress(RuntimeError, AssertionError):
        torch.zeros(1, device="cuda")


def _unlock(tensor: torch.Tensor) -> None:
    rt = torch.cuda.cudart()
    err = rt.cudaHostUnregister(tensor.untyped_storage().data_ptr())
    if err != rt.cudaError.success:
        _consume_cuda_error()
        raise RuntimeError(f"cudaHostUnregister failed: {rt.cudaGetErrorString(err)}")


_PROCESS = PinnedHost()
_CURRENT: ContextVar[PinnedHost] = ContextVar("tightfit_pinned_host", default=_PROCESS)


def current() -> PinnedHost:
    """The accountant pinned memory made now is counted by: the innermost :func:`sharing`'s,
    else the process's (no budget but the machine's room)."""
    return _CURRENT.get()


@contextlib.contextmanager
def sharing(host: PinnedHost) -> Iterator[PinnedHost]:
    """Within the block, pools, page stores and copy engines that are made count their
    pinned memory with ``host`` (for as long as they live): one budget for all of them."""
    token = _CURRENT.set(host)
    try:
        yield host
    finally:
        _CURRENT.reset(token)
