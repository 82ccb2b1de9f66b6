"""The CPU device tier as slabs: one contiguous array per state name for a run of pages.

Why: torch's CPU fused kernels (``_fused_adamw_`` …) run one parallel section per tensor they
are given. With each page in its own buffer, a 50M-param step hands the kernel ~48 page views
and, on 2 threads, pays for ~48 thread fork/joins and the imbalance of each: up to 1.33 × one
call at 4 MiB pages, 1.17 × at 8 MiB (benchmarks/results/optimizer_pagesize.md). In a slab, ``exp_avg`` of every page of a run
is one array (likewise ``exp_avg_sq``, codes, absmax), page after page, so the state of a param
split over resident pages is one contiguous view and the sweep calls the kernel once per param,
as torch does (see ``PagedOptimizer._update_pages``).

Eviction still returns memory: the slab is a private anonymous mapping, and when a page leaves
the device the OS pages its arrays cover alone are handed back with ``madvise(MADV_DONTNEED)``
(they read as zeros if touched again). An OS page shared with a resident neighbour stays, so a
released page can leave up to one OS page per array end behind; the byte counters count pages,
not OS pages. Pages elsewhere (disk, window slots, CUDA) keep the one-buffer-per-page format,
which is also the spill-file and save-file format: a move copies each array range separately.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import platform
import sys
from collections.abc import Callable

import torch

from tightfit.paging.layout import Page

_OS_PAGE = mmap.PAGESIZE
# MAP_NORESERVE (Linux; Python does not export it): a slab maps a whole run's state, which
# may exceed RAM + swap when most of it lives on disk; without it the kernel's overcommit
# heuristic refuses such a mapping (ENOMEM) even though only resident pages are ever touched.
_MAP_NORESERVE = 0x4000 if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64") else 0


def slabs_supported() -> bool:
    """Whether this platform gives memory back from the middle of a mapping at once (Linux:
    ``MADV_DONTNEED`` on private anonymous memory frees it; elsewhere it is only advice)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


def page_runs(pages: list[Page]) -> list[list[Page]]:
    """``pages`` cut into runs that can share a slab: consecutive, same group, dtype, arrays."""
    runs: list[list[Page]] = []
    for page in pages:
        key = _run_key(page)
        if runs and _run_key(runs[-1][-1]) == key and runs[-1][-1].index + 1 == page.index:
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs


def _run_key(page: Page) -> tuple:
    return (page.group, page.dtype, tuple((n, a[2], a[3]) for n, a in page.arrays.items()))


class SlabViews(dict):
    """A page's arrays (name -> flat typed view) that live in ``slab``: views of consecutive
    pages of one slab continue each other, which :mod:`tightfit.paging.coalesce` relies on."""

    def __init__(self, slab: Slab, views: dict[str, torch.Tensor]) -> None:
        super().__init__(views)
        self.slab = slab


class Slab:
    """The memory of one run of pages on the CPU device tier, one array per state name.

    Args:
        pages: a run from :func:`page_runs`.
    """

    def __init__(self, pages: list[Page]) -> None:
        names = list(pages[0].arrays)
        counts = {n: 0 for n in names}
        self._first: dict[int, dict[str, int]] = {}  # page index -> element offset per array
        for page in pages:
            self._first[page.index] = dict(counts)
            for n in names:
                counts[n] += page.arrays[n][1]
        # each array starts on an OS page, so whole pages of it can be released
        self._base: dict[str, int] = {}
        size = 0
        for n in names:
            self._base[n] = size
            nbytes = counts[n] * pages[0].arrays[n][2].itemsize
            size += -(-nbytes // _OS_PAGE) * _OS_PAGE
        # MAP_PRIVATE | MAP_ANONYMOUS: zero-filled on first touch, untouched pages cost nothing.
        # Raises OSError where the mapping is refused; the store then keeps the run's pages in
        # one buffer each.
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.arrays = {
            n: raw[self._base[n] : self._base[n] + counts[n] * pages[0].arrays[n][2].itemsize].view(
                pages[0].arrays[n][2]
            )
            for n in names
        }
        # byte starts of each page's range in each array (sorted), for release decisions
        self._pages = pages
        self._starts = {n: [self._byte_range(p, n)[0] for p in pages] for n in names}

    def _byte_range(self, page: Page, name: str) -> tuple[int, int]:
        _off, numel, dtype, _block = page.arrays[name]
        start = self._base[name] + self._first[page.index][name] * dtype.itemsize
        return start, start + numel * dtype.itemsize

    def views(self, page: Page) -> SlabViews:
        """Typed flat views of ``page``'s arrays inside the slab."""
        first = self._first[page.index]
        return SlabViews(
            self, {n: self.arrays[n][first[n] : first[n] + page.arrays[n][1]] for n in self.arrays}
        )

    def release(self, page: Page, resident: Callable[[Page], bool]) -> int:
        """Give the OS pages under ``page``'s arrays back, except those a resident page shares.

        Returns:
            Bytes handed back.
        """
        freed = 0
        for n in self.arrays:
            a, b = self._byte_range(page, n)
            lo = a // _OS_PAGE * _OS_PAGE
            hi = -(-b // _OS_PAGE) * _OS_PAGE
            # the partial OS pages at either end go only if no resident page overlaps them
            if lo < a and not self._free_of_residents(n, lo, lo + _OS_PAGE, resident):
                lo += _OS_PAGE
            if (
                hi > b
                and hi - _OS_PAGE >= lo
                and not self._free_of_residents(n, hi - _OS_PAGE, hi, resident)
            ):
                hi -= _OS_PAGE
            if hi > lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                freed += hi - lo
        return freed

    def _free_of_residents(
        self, name: str, lo: int, hi: int, resident: Callable[[Page], bool]
    ) -> bool:
        starts = self._starts[name]
        first = max(bisect.bisect_right(starts, lo) - 1, 0)
        for k in range(first, len(self._pages)):
            page = self._pages[k]
            a, b = self._byte_range(page, name)
            if a >= hi:
                break
            if b > lo and resident(page):
                return False
        return True

    def close(self) -> None:
        """Drop the views and unmap (once no tensor refers to the memory any more)."""
        self.arrays = {}
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._map.close()
