"""The disk tier: memory-mapped spill files under a private folder.

On a CPU-only machine the device and the host are one place, so the next tier is the disk:
a file per owner (a param group of a paged optimizer, or a run of offloaded activations),
mapped ``MAP_SHARED`` so that written bytes can be handed back to the OS
(:meth:`SpillArea.release`). Disk blocks are reserved (``posix_fallocate``) for the ranges that
will hold bytes before anything is written there (:meth:`SpillArea.commit`,
:meth:`SpillArea.allocate`), so a full disk is an ``OSError``, not a bus error; the rest of a
file stays sparse and costs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from tightfit.integrity.owners import Removed, remove_stale, write_owner
from tightfit.measure import tracker

SPILL_PREFIX = "tightfit-spill-"  # every private spill folder's name starts so


def check_spill_dir(spill_dir: str | os.PathLike | None) -> None:
    """Raise ``ValueError`` now if ``spill_dir`` cannot hold spill files (nothing is kept)."""
    if spill_dir is None:
        return
    path = Path(spill_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"spill_dir={str(path)!r} is a file, not a folder; pass a folder path (it is created "
            "if missing) or spill_dir=None for a temporary folder"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tightfit-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(
            f"spill_dir={str(path)!r} cannot be written ({exc.strerror or exc}); pass a writable "
            "folder or spill_dir=None for a temporary folder"
        ) from None


_MS_SYNC = 4  # <sys/mman.h> on Linux
_MADV_DONTNEED = 4
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writing dirty pages back, do not wait
_PAGE = mmap.PAGESIZE


def _fallocate(fd: int, offset: int, nbytes: int) -> None:
    """Allocate the blocks of a file range (or write zeros where the call does not exist)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, nbytes)
        return
    zeros = bytes(min(nbytes, 1 << 20))  # macOS, Windows: writing is the only reservation
    for start in range(offset, offset + nbytes, len(zeros)):
        os.pwrite(fd, zeros[: min(len(zeros), offset + nbytes - start)], start)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.msync, libc.madvise):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    libc.sync_file_range.restype = ctypes.c_int
    return libc


def release_range(view: torch.Tensor) -> None:
    """``msync`` + ``madvise(MADV_DONTNEED)`` the whole pages of a spill map ``view`` covers.

    The data stays in the file (read back on the next access) and leaves this process's RSS;
    see :meth:`SpillArea.release`. Partial pages at either end are left alone (a neighbour
    may be using them). Linux only; a no-op elsewhere.
    """
    libc = _libc()
    if libc is None or view.numel() == 0:
        return
    start, end = view.data_ptr(), view.data_ptr() + view.numel()
    first = -(-start // _PAGE) * _PAGE
    length = (end // _PAGE) * _PAGE - first
    if length > 0 and libc.msync(first, length, _MS_SYNC) == 0:
        libc.madvise(first, length, _MADV_DONTNEED)


class SpillArea:
    """Spill files, one per param group, created on first use and deleted by :meth:`close`.

    Files live in a private folder made inside ``spill_dir`` (or the system temp folder), so
    closing never touches anything the user put there. The folder holds an owner file
    (:mod:`tightfit.integrity.owners`), and a new area removes the sibling folders whose process is
    gone (a crash cannot delete its own): :attr:`cleaned` says what it removed.
    """

    def __init__(self, spill_dir: str | os.PathLike | None) -> None:
        self._parent = None if spill_dir is None else str(spill_dir)
        self._folder: str | None = None
        self._sizes: dict[int, int] = {}
        self._maps: dict[int, torch.Tensor] = {}
        self._fds: dict[int, int] = {}  # files made by commit(), kept open for check()
        self.cleaned: list[Removed] = remove_stale(
            self._parent or tempfile.gettempdir(), SPILL_PREFIX
        )

    @property
    def folder(self) -> str | None:
        """The private folder holding the spill files, once one exists."""
        return self._folder

    def reserve(self, group: int, nbytes: int) -> None:
        """Declare the size of a group's spill file (all of its pages, back to back)."""
        self._sizes[group] = nbytes

    def _path(self, group: int) -> str:
        if self._folder is None:
            folder = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=self._parent)
            try:
                write_owner(folder)  # before any spill file: a crash leaves a cleanable folder
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._folder = folder
        return os.path.join(self._folder, f"group{group}.spill")

    @property
    def location(self) -> str:
        """The private folder, or (before it exists) the folder it will be made in."""
        return self._folder or self._parent or tempfile.gettempdir()

    def free_bytes(self) -> int:
        """Bytes free for this user on the file system of :attr:`location`."""
        return shutil.disk_usage(self.location).free

    def commit(self, group: int, offset: int, nbytes: int) -> None:
        """Reserve disk blocks for bytes ``[offset, offset + nbytes)`` of a group's file.

        The file (of the size :meth:`reserve` declared) is made on first use and stays
        sparse elsewhere: only ranges that will hold pages take disk. Reserved blocks
        (``posix_fallocate``) cannot run out later, so a full disk is this ``OSError`` and
        never a bus error in the middle of a copy. A reserved range reads as zeros.

        Raises:
            OSError: the file system has no room (``ENOSPC``) or the file cannot be made; a
                file made by this call is removed again (and a folder left empty with it).
        """
        opened = group not in self._fds
        made = False
        try:
            if opened:
                path = self._path(group)
                made = not os.path.exists(path)
                self._fds[group] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                if os.fstat(self._fds[group]).st_size < self._sizes[group]:
                    os.ftruncate(self._fds[group], self._sizes[group])
            _fallocate(self._fds[group], offset, nbytes)
        except BaseException:
            if opened:
                self._undo(group, made)
            raise

    def _undo(self, group: int, remove: bool) -> None:
        """Forget a file :meth:`commit` failed to make: close it, and remove it (and the
        folder, when nothing else of ours is in it) if this call made it."""
        fd = self._fds.pop(group, None)
        if fd is not None:
            os.close(fd)
        if remove and self._folder is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(group))
            if not self._fds and not self._maps:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None

    def check(self, group: int, offset: int, nbytes: int) -> None:
        """Raise ``OSError`` if a group's file no longer holds ``[offset, offset + nbytes)``.

        A mapped file that was truncated under us raises ``SIGBUS`` on the next touch, which
        Python cannot catch: callers check first. Files not made by :meth:`commit` are not
        checked.
        """
        fd = self._fds.get(group)
        if fd is None:
            return
        size = os.fstat(fd).st_size
        if size < offset + nbytes:
            raise OSError(
                errno.EIO,
                f"the spill file was truncated to {size} bytes under this process, which keeps "
                f"state up to byte {offset + nbytes} in it: something outside tightfit changed "
                "it (a cleaner, another process); that state is lost",
                self._path(group),
            )

    def allocate(self, group: int, nbytes: int) -> torch.Tensor:
        """A group's spill file of ``nbytes``, reserved on disk whole (:meth:`commit`) and
        mapped: a region pool's chunk (offloaded activations fill it over and over).

        Raises:
            OSError: as :meth:`commit` (``ENOSPC``: no room); nothing is left behind.
        """
        self.reserve(group, nbytes)
        self.commit(group, 0, nbytes)
        return self.region(group, 0, nbytes)

    def region(self, group: int, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of the group's spill file, mapping it on first use."""
        mapped = self._maps.get(group)
        if mapped is None:
            path = self._path(group)
            # MAP_SHARED over a sparse file: untouched pages cost no disk and read as zeros.
            # Not counted by MemoryTracker: it is the disk tier (its touched pages are page
            # cache, which release() hands back), not memory a step allocates.
            with tracker.not_counted():
                mapped = torch.from_file(
                    path, shared=True, size=self._sizes[group], dtype=torch.uint8
                )
            self._maps[group] = mapped
        return mapped[offset : offset + nbytes]

    def release(self) -> None:
        """Drop the spill maps' pages from this process's RSS, and start writing them back.

        A page written into the ``MAP_SHARED`` spill map stays mapped — counted in RSS and, as
        dirty page cache, charged to a memory cgroup — until the kernel gets round to it; under
        memory pressure (see ``tightfit.pressure.occupancy``) that is too late.
        ``madvise(MADV_DONTNEED)`` unmaps them from this process at once (the data stays in
        the file's page cache, read back on the next access), and ``sync_file_range`` starts
        writing the dirty ones to disk without waiting, so the kernel can drop them as soon as
        memory is short, while a restore soon after still reads them from the cache. (Until
        this change: ``msync(MS_SYNC)`` first, which waited for the disk — 0.40-0.52 s of the
        0.64-0.78 s an eviction of 112 MiB took under a memory cgroup on the build machine,
        against 0.34-0.40 s now; ``benchmarks/results/spike_cli.md``.) Linux only; a no-op
        elsewhere.
        """
        libc = _libc()
        if libc is None:
            return
        for group, mapped in self._maps.items():
            addr, length = mapped.data_ptr(), mapped.numel()
            if length:
                libc.madvise(addr, length, _MADV_DONTNEED)
                fd = self._fds.get(group)
                if fd is not None:
                    libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> None:
        """Unmap and delete every spill file and the private folder."""
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
