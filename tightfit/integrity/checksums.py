"""Checksums of state bytes that leave RAM, and the error a mismatch raises.

Every page written to the disk tier gets a checksum, verified when it is read back; saved files
carry a checksum per page too. The checksum is 64-bit XXH3 (the ``xxhash`` package), chosen by
measured speed (``benchmarks/results/checksums*.md``): ~10-18 GiB/s per core on pages read from
RAM and 100-120 GiB/s on 256 KiB in cache (27-74 GiB/s through :func:`checksum`, whose checks
and conversion cost about as much as the hash at that size) on the 2-core build machine, 4-6 x
zlib's CRC-32; a torch ``int64`` sum is as fast but order-blind (two opposite bit flips
cancel). A disk page's checksum is that of its :data:`CHUNK` chunks' digests
(:func:`page_checksum`, its :data:`STRIPE` stripes hashed on several threads when the page is
only read). The sweep's copies (:func:`copy_and_checksum`, its stripes
on the copy worker and the hash pool) hash in the copy pass itself: each :data:`CHUNK` is
copied, then hashed while it is still in the core's cache, so the hash never reads RAM again;
the copies release the GIL and so does XXH3, so all of it overlaps the update.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch
import xxhash

ALGORITHM = "xxh3_64"  # the name saved alongside a checksum, so a file says how it was made
CHUNK = 256 << 10  # a disk page's checksum combines the digests of chunks of this many bytes
STRIPE = 4 << 20  # the share of a page one thread copies and hashes, a whole number of chunks
PAGE_ALGORITHM = f"{ALGORITHM} of {CHUNK >> 10} KiB chunks"  # what page_checksum computes
assert STRIPE % CHUNK == 0


class CorruptStateError(RuntimeError):
    """State bytes read back from a slower tier (or a file) do not match their checksum, or
    could not be written there: the state they hold is lost, and is never used.

    Args:
        message: The whole message: what is wrong, then what to do.
        what: What is wrong alone (default: ``message``), for callers that say what to do in
            their own words (``tightfit train --resume``).
    """

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = message if what is None else what


def _check_bytes(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError(
            f"checksum() takes the bytes of a page: a contiguous uint8 CPU tensor, not a "
            f"{'non-contiguous ' if not data.is_contiguous() else ''}{data.dtype} tensor on "
            f"{data.device}; pass buf.view(torch.uint8) of a CPU buffer"
        )


def checksum(data: torch.Tensor) -> int:
    """The :data:`ALGORITHM` checksum of a contiguous CPU uint8 tensor's bytes.

    Raises:
        ValueError: ``data`` is not a contiguous uint8 tensor in CPU memory.
    """
    _check_bytes(data)
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))


@functools.cache
def _pool() -> tuple[ThreadPoolExecutor, int]:
    # helpers beside the calling thread (the copy worker): the cores torch may use, less one
    n = max(1, torch.get_num_threads() - 1)
    return ThreadPoolExecutor(n, "tightfit-hash"), n


if hasattr(os, "register_at_fork"):  # a forked child has the pool's objects, not its threads
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _striped(nbytes: int, one: Callable[[slice], list[int]]) -> int:
    """Run ``one`` on every :data:`STRIPE` of a page of ``nbytes`` bytes, the calling thread
    and the hash pool taking stripes in turn, and combine the digests of the stripes' chunks
    (``one``'s lists) in order.

    A helper that has not started when the caller has taken the last stripe is cancelled, not
    waited for: with copies on several threads at once (two optimizers, an offloader) the pool
    may be busy with another page's stripe, and this page is already done."""
    stripes = [slice(a, min(a + STRIPE, nbytes)) for a in range(0, max(nbytes, 1), STRIPE)]
    if len(stripes) == 1:
        return _combine(one(stripes[0]))
    digests: list[list[int]] = [[]] * len(stripes)
    ticket = itertools.count()  # next() on a count is atomic under the GIL

    def run() -> None:
        while (i := next(ticket)) < len(stripes):
            digests[i] = one(stripes[i])

    pool, size = _pool()
    helpers = [pool.submit(run) for _ in range(min(size, len(stripes) - 1))]
    try:
        run()
    finally:  # never return, nor raise, while a helper still touches the buffers
        # a helper not yet started would find no stripe left: cancelled, it never runs (and
        # wait() would block on it until a pool thread dequeued it, so it is not waited for)
        started = [h for h in helpers if not h.cancel()]
        wait(started)
    for h in started:
        h.result()  # a helper's exception is the caller's
    return _combine([d for stripe in digests for d in stripe])


def copy_threads(nbytes: int) -> int:
    """How many threads :func:`copy_and_checksum` of a page of ``nbytes`` keeps busy at once:
    one per :data:`STRIPE`, up to the calling thread and the hash pool's helpers."""
    return min(-(-max(nbytes, 1) // STRIPE), 1 + _pool()[1])


def page_checksum(data: torch.Tensor) -> int:
    """The checksum of a disk-tier page: the :data:`ALGORITHM` digest of each :data:`CHUNK` of
    its bytes, then that of those digests (a page of one chunk: its :func:`checksum`); the
    chunks of each :data:`STRIPE` hashed on one of several cores. The disk tier's checksums
    live in memory and are only ever compared with each other, so the chunks are a speed
    choice (a one-shot XXH3 of 256 KiB in cache ran 116.6 GiB/s here, a streaming update of
    the same bytes 72.6 GiB/s: ``benchmarks/results/checksums.md``), not a file format.

    Raises:
        ValueError: ``data`` is not a contiguous uint8 tensor in CPU memory.
    """
    _check_bytes(data)
    view = memoryview(data.numpy())
    return _striped(data.numel(), functools.partial(_hash_stripe, view))


def _chunks(stripe: slice) -> list[tuple[int, int]]:
    return [(x, min(x + CHUNK, stripe.stop)) for x in range(stripe.start, stripe.stop, CHUNK)]


def _hash_stripe(view: memoryview, stripe: slice) -> list[int]:
    """The digests of one stripe's chunks."""
    return [xxhash.xxh3_64_intdigest(view[x:y]) for x, y in _chunks(stripe)]


def _combine(digests: list[int]) -> int:
    """The page checksum of its chunks' digests (a page of one chunk: that chunk's)."""
    if len(digests) == 1:
        return digests[0]
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


def _copy_stripe(dst: np.ndarray, src: np.ndarray, landed: memoryview, stripe: slice
                 ) -> list[int]:
    """Copy one stripe :data:`CHUNK` by chunk, hashing each chunk as it landed in ``dst``
    while it is in cache; the digests of the stripe's chunks."""
    digests = []
    for x, y in _chunks(stripe):
        np.copyto(dst[x:y], src[x:y])
        digests.append(xxhash.xxh3_64_intdigest(landed[x:y]))
    return digests


def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copy ``src`` into ``dst``; return the :func:`page_checksum` of what landed in ``dst``.

    Both are contiguous uint8 CPU tensors of one size. One pass over the bytes: each
    :data:`STRIPE` is copied :data:`CHUNK` by chunk (numpy's copy, which releases the GIL),
    each chunk hashed from ``dst`` while it is still in the core's cache, so hashing costs
    XXH3's in-cache speed and no second read of RAM; the stripes go to the calling thread (the
    copy worker) and the hash pool in turn, as :func:`page_checksum`'s do, and the chunks'
    digests combine as there. Spreading the stripes takes a page's faults on
    the spill map on two threads at once (two stripes read from disk when the file is not in
    the page cache), as the striped torch copy before the chunked one did; a helper that is
    late finds no stripe left and is cancelled. What it costs and saves, measured on a loaded
    machine, is in ``benchmarks/results/checksums.md`` and ``docs/paging.md``.
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy_and_checksum: {dst.numel()} bytes to {src.numel()}")
    _check_bytes(dst), _check_bytes(src)
    d, s = dst.numpy(), src.numpy()
    return _striped(d.size, functools.partial(_copy_stripe, d, s, memoryview(d)))


@functools.cache
def zeros_checksum(nbytes: int) -> int:
    """The :func:`page_checksum` of ``nbytes`` zero bytes (a page that was never written)."""
    return page_checksum(torch.zeros(nbytes, dtype=torch.uint8))


def file_checksum(path: str | os.PathLike[str], chunk: int = 1 << 20) -> int:
    """The :data:`ALGORITHM` checksum of a whole file's bytes, read ``chunk`` bytes at a time
    (a file of any size in bounded memory)."""
    digest = xxhash.xxh3_64()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            digest.update(view[:n])
    return digest.intdigest()
