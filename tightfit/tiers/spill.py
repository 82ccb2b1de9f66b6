"""The disk tier: memory-mapped spill files under a private folder.

On a CPU-only machine the device and the host are one place, so the next tier is the disk:
a sparse file per owner (a param group of a paged optimizer, or a run of offloaded
activations), mapped ``MAP_SHARED`` so that untouched bytes cost nothing and written bytes can be
handed back to the OS (:meth:`SpillArea.release`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from tightfit.measure import tracker


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


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.msync, libc.madvise):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return libc


class SpillArea:
    """Spill files, one per param group, created on first use and deleted by :meth:`close`.

    Files live in a private folder made inside ``spill_dir`` (or the system temp folder), so
    closing never touches anything the user put there.
    """

    def __init__(self, spill_dir: str | os.PathLike | None) -> None:
        self._parent = None if spill_dir is None else str(spill_dir)
        self._folder: str | None = None
        self._sizes: dict[int, int] = {}
        self._maps: dict[int, torch.Tensor] = {}

    @property
    def folder(self) -> str | None:
        """The private folder holding the spill files, once one exists."""
        return self._folder

    def reserve(self, group: int, nbytes: int) -> None:
        """Declare the size of a group's spill file (all of its pages, back to back)."""
        self._sizes[group] = nbytes

    def region(self, group: int, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of the group's spill file, mapping it on first use."""
        mapped = self._maps.get(group)
        if mapped is None:
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="tightfit-spill-", dir=self._parent)
            path = os.path.join(self._folder, f"group{group}.spill")
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
        """Write dirty spill pages to their files and drop them from this process's RSS.

        A page written into the ``MAP_SHARED`` spill map stays resident — counted in RSS and
        charged to a memory cgroup as dirty page cache — until the kernel gets round to it;
        under memory pressure (see ``tightfit.paging.occupancy``) that is too late. ``msync``
        makes the pages clean (so the kernel can drop them at once) and
        ``madvise(MADV_DONTNEED)`` unmaps them from this process; the data stays in the file
        and is read back on the next access. Linux only; a no-op elsewhere.
        """
        libc = _libc()
        if libc is None:
            return
        for mapped in self._maps.values():
            addr, length = mapped.data_ptr(), mapped.numel()
            if length and libc.msync(addr, length, _MS_SYNC) == 0:
                libc.madvise(addr, length, _MADV_DONTNEED)

    def close(self) -> None:
        """Unmap and delete every spill file and the private folder."""
        self._maps.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
