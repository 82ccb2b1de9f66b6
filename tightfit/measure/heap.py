"""Handing freed heap memory back to the OS (glibc's ``malloc_trim``).

glibc keeps freed heap pages mapped, so bytes a tier gave back (a paged weight resized to 0,
an optimizer page freed on the CPU) stay in the process's RSS — where a memory probe or the
cgroup still counts them — until ``malloc_trim`` returns them. A 4 MiB buffer is under glibc's
mmap threshold once that threshold has grown, so ``free`` alone may keep it.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc (e.g. musl)
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the OS where the C library can (glibc on Linux).

    Returns:
        Whether ``malloc_trim`` was called (``False``: not glibc, nothing to call).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
