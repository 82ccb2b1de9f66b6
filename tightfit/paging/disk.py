"""Pages in the disk tier: room reserved before placing, files checked, bytes checksummed.

Three promises (``docs/paging.md``, "Failure and integrity"):

* **Room first.** Before pages are placed on disk their ranges of the spill file get disk
  blocks (:func:`reserve`), so a disk without room is an ``OSError`` naming the folder and the
  bytes, raised before any page moved, never a bus error in the middle of a copy.
* **Checked before touched.** A spill file truncated under the process would raise ``SIGBUS``
  on the next access of its mapping; every access checks the file's size first
  (:meth:`~tightfit.tiers.spill.SpillArea.check`), so that is an ``OSError`` too.
* **Checksummed.** Each write of a page to disk records the checksum of its bytes
  (:mod:`tightfit.integrity.checksums`), each read verifies it, and a mismatch raises
  :class:`~tightfit.integrity.checksums.CorruptStateError` naming the page, its params and the
  tier; the bytes are never used. A write that failed marks the page lost, so a later read
  says so instead of returning stale state.

The sweep's copies run on the copy worker through :class:`DiskHome`, a page's stripes shared
with the hash pool (copied and hashed while the update runs, and faulted in from the spill file
on two threads at once); the store's moves between steps use :func:`read` and :func:`write`.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import torch

from tightfit.integrity.checksums import (
    PAGE_ALGORITHM,
    CorruptStateError,
    copy_and_checksum,
    page_checksum,
    zeros_checksum,
)
from tightfit.paging.layout import Page
from tightfit.tiers.spill import SpillArea

_NAMED = 3  # params a page's description names one by one
_RESUME = "restart from your last saved state (opt.load(path), tightfit train --resume)"


def describe(page: Page) -> str:
    """``'page 12 (param group 0: param 3 elements 0..1048575, param 4 elements 0..4095)'``;
    past three params, ``'..., 25 more params (3..27))'``."""
    parts = []
    for seg in page.segments[:_NAMED]:
        end = seg.start + seg.length - 1
        parts.append(f"param {seg.param} elements {seg.start}..{end}")
    if len(page.segments) > _NAMED:  # a page of many small params: the rest by index range
        rest = page.segments[_NAMED:]
        parts.append(f"{len(rest)} more params ({rest[0].param}..{rest[-1].param})")
    return f"page {page.index} (param group {page.group}: {', '.join(parts) or 'no params'})"


def _where(spill: SpillArea, page: Page) -> str:
    return (f"the disk tier (spill folder {spill.folder}, file group{page.group}.spill, bytes "
            f"{page.spill_offset}..{page.spill_offset + page.nbytes - 1})")


def verify(spill: SpillArea, page: Page, data: torch.Tensor, found: int | None = None) -> None:
    """Raise :class:`CorruptStateError` unless ``data`` (a CPU copy of the page's disk bytes,
    or the mapping itself; ``found``: its checksum, when already known) matches the checksum
    of the last write."""
    if page.spill_lost is not None:
        raise CorruptStateError(
            f"the optimizer state of {describe(page)} in {_where(spill, page)} is lost: "
            f"{page.spill_lost}. It was not used; {_RESUME}"
        )
    if found is None:
        found = page_checksum(data)
    if found != page.spill_checksum:
        expected = "none" if page.spill_checksum is None else f"{page.spill_checksum:#018x}"
        raise CorruptStateError(
            f"the optimizer state of {describe(page)} read back from {_where(spill, page)} "
            f"does not match its checksum ({PAGE_ALGORITHM} {expected} written, {found:#018x} "
            f"read): the file was changed outside this optimizer (a disk or memory fault, "
            f"another process writing it). The bad state was not used; {_RESUME}"
        )


def read(spill: SpillArea, page: Page) -> torch.Tensor:
    """The page's disk region (a view of the spill map), checked and verified."""
    spill.check(page.group, page.spill_offset, page.nbytes)
    region = spill.region(page.group, page.spill_offset, page.nbytes)
    verify(spill, page, region)
    return region


def read_copy(spill: SpillArea, page: Page) -> torch.Tensor:
    """A CPU copy of the page's disk bytes, checked, and verified (the copy is what is used)."""
    spill.check(page.group, page.spill_offset, page.nbytes)
    out = spill.region(page.group, page.spill_offset, page.nbytes).clone()
    verify(spill, page, out)
    return out


def write(
    spill: SpillArea,
    page: Page,
    data: torch.Tensor | dict[str, torch.Tensor] | None,
    copy: Callable[[torch.Tensor, torch.Tensor], object] = torch.Tensor.copy_,
) -> None:
    """Write a page's bytes (one buffer, or its arrays) to its reserved disk region and record
    their checksum; ``None``: a new page, whose freshly reserved region reads as zeros."""
    spill.check(page.group, page.spill_offset, page.nbytes)
    if data is None:
        page.spill_checksum = zeros_checksum(page.nbytes)
        page.spill_lost = None
        return
    region = spill.region(page.group, page.spill_offset, page.nbytes)
    try:
        page.copy_state(region, data, copy)
        page.spill_checksum = page_checksum(region)
        page.spill_lost = None
    except BaseException as exc:
        page.spill_lost = f"writing it failed ({type(exc).__name__}: {exc})"
        raise


class DiskHome:
    """A disk page as a :class:`~tightfit.tiers.copy.Home`: the copy engine's worker reads and
    writes it, checking the file first and hashing on the way (overlapping the update)."""

    def __init__(self, spill: SpillArea, page: Page) -> None:
        self.spill, self.page = spill, page

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the page's bytes into ``dst`` and verify them there (what the update uses)."""
        page = self.page
        self.spill.check(page.group, page.spill_offset, page.nbytes)
        region = self.spill.region(page.group, page.spill_offset, page.nbytes)
        verify(self.spill, page, dst, copy_and_checksum(dst, region))

    def write_from(self, src: torch.Tensor) -> None:
        """Write ``src`` (the updated page) to disk; a failure marks the page lost, since its
        update then lives nowhere else once the slot is reused."""
        page = self.page
        try:
            self.spill.check(page.group, page.spill_offset, page.nbytes)
            region = self.spill.region(page.group, page.spill_offset, page.nbytes)
            page.spill_checksum = copy_and_checksum(region, src)
            page.spill_lost = None
        except BaseException as exc:
            page.spill_lost = f"its write-back failed ({type(exc).__name__}: {exc})"
            raise


def reserve(spill: SpillArea, pages: list[Page], device_hint: str) -> None:
    """Reserve disk blocks for every page in ``pages`` that has none yet, before any moves.

    Args:
        spill: the store's spill area.
        pages: the pages a plan puts on disk.
        device_hint: what to raise to keep pages off disk (``"device_budget"`` …), for the
            message.

    Raises:
        OSError: the spill folder's file system has no room for them; nothing was moved
            (ranges reserved before the failure stay reserved for later).
    """
    need = [p for p in pages if not p.spill_reserved]
    if not need:
        return
    total = sum(p.nbytes for p in need)
    free = spill.free_bytes()

    def no_room(errno_: int, why: str) -> OSError:
        where = spill.location
        return OSError(
            errno_,
            f"the disk tier has no room: {total} bytes of optimizer state ({len(need)} pages) "
            f"must be placed in the spill folder {where}, whose file system has {free} bytes "
            f"free ({why}). Pass spill_dir= a folder with at least {total} bytes free, or "
            f"raise {device_hint} so that fewer pages go to disk. Nothing was changed",
            where,
        )

    if free < total:
        raise no_room(errno.ENOSPC, "not enough free space")
    for run in _runs(need):
        first = run[0]
        try:
            spill.commit(first.group, first.spill_offset, sum(p.nbytes for p in run))
        except OSError as exc:
            raise no_room(exc.errno or errno.ENOSPC, exc.strerror or str(exc)) from None
        for p in run:
            p.spill_reserved = True


def _runs(pages: list[Page]) -> list[list[Page]]:
    """``pages`` cut into runs that lie back to back in one group's spill file."""
    runs: list[list[Page]] = []
    for page in sorted(pages, key=lambda p: (p.group, p.spill_offset)):
        last = runs[-1][-1] if runs else None
        if (last is not None and last.group == page.group
                and last.spill_offset + last.nbytes == page.spill_offset):
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs
