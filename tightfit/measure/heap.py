"""Handing freed heap memory back to the OS (glibc's ``malloc_trim``, ``mallopt``).

glibc keeps freed heap pages mapped, so bytes a tier gave back (a paged weight resized to 0,
an optimizer page freed on the CPU) stay in the process's RSS — where a memory probe or the
cgroup still counts them — until ``malloc_trim`` returns them. A 4 MiB buffer is under glibc's
mmap threshold once that threshold has grown, so ``free`` alone may keep it.

The threshold grows by itself: each ``free`` of an mmapped block raises it to that block's size
(up to 32 MiB on 64-bit), after which a step's activations come from the heap and their freed
pages stay in the RSS between steps. :func:`fix_mmap_threshold` stops that for a CPU run, so the
process's memory follows its live tensors: measured on one ``tightfit train`` (8,192 tokens,
benchmarks/results/long_context_cgroup.md) the RSS between steps fell from 914 to 561 MiB and
the step's peak from 1,164 to 834 MiB.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    """glibc's ``name`` on Linux; ``None`` elsewhere or when the C library lacks it (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None


MMAP_THRESHOLD = 1 << 20  # blocks from 1 MiB up are mmapped, and unmapped when freed


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (``mallopt(M_MMAP_THRESHOLD)``), which also
    stops it from growing; then trim what the heap holds free.

    For a process whose tensors live in host memory (a CPU run): every block of ``nbytes`` or
    more then goes back to the OS when freed, at the price of fresh pages (page faults) for
    each new one. ``tightfit train`` calls it for a CPU run; it is process-wide, so the library
    (:func:`tightfit.prepare`) does not.

    Returns:
        Whether the threshold was set (``False``: not glibc).
    """
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    m_mmap_threshold = -3  # malloc.h
    ok = bool(mallopt(m_mmap_threshold, int(nbytes)))
    trim_heap()
    return ok


def trim_heap() -> bool:
    """Return the heap's free pages to the OS where the C library can (glibc on Linux).

    Returns:
        Whether ``malloc_trim`` was called (``False``: not glibc, nothing to call).
    """
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
