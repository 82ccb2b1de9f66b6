"""Checksums of state bytes that leave RAM, and the error a mismatch raises.

Every page written to the disk tier gets a checksum, verified when it is read back (and saved
files may carry the same checksum per page). The checksum is 64-bit XXH3 (the ``xxhash``
package), chosen by measured speed (``benchmarks/results/checksums.md``): on 8 MiB pages read
from RAM it hashed at ~4-6 GiB/s on one core of the 2-core build machine, 3 x zlib's CRC-32; a
torch ``int64`` sum was as fast or faster but is order-blind (two opposite bit flips cancel)
and, run from the copy worker, competes with the update for torch's intra-op threads. XXH3
releases the GIL, so the copy worker hashes while the update runs (``docs/paging.md``, "Failure
and integrity").
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import xxhash

ALGORITHM = "xxh3_64"  # the name saved alongside a checksum, so a file says how it was made
_CHUNK = 256 << 10  # bytes copied then hashed at a time: stays in a core's cache


class CorruptStateError(RuntimeError):
    """State bytes read back from a slower tier (or a file) do not match their checksum, or
    could not be written there: the state they hold is lost, and is never used."""


def checksum(data: torch.Tensor) -> int:
    """The :data:`ALGORITHM` checksum of a contiguous CPU uint8 tensor's bytes.

    Raises:
        ValueError: ``data`` is not a contiguous uint8 tensor in CPU memory.
    """
    if data.dtype != torch.uint8 or data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError(
            f"checksum() takes the bytes of a page: a contiguous uint8 CPU tensor, not a "
            f"{'non-contiguous ' if not data.is_contiguous() else ''}{data.dtype} tensor on "
            f"{data.device}; pass buf.view(torch.uint8) of a CPU buffer"
        )
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))


def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copy ``src`` into ``dst`` and return the checksum of the bytes that landed in ``dst``.

    Both are contiguous uint8 CPU tensors of one size. The copy goes in cache-sized chunks and
    each chunk is hashed while it is still in cache: a page is read from RAM once, not twice
    (1.06-1.5 x a bare copy on the build machine, against 1.3-1.8 x for a copy, then a hash).
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy_and_checksum: {dst.numel()} bytes to {src.numel()}")
    out, inp = dst.numpy(), src.numpy()
    digest = xxhash.xxh3_64()
    for start in range(0, out.size, _CHUNK):
        np.copyto(out[start : start + _CHUNK], inp[start : start + _CHUNK])
        digest.update(memoryview(out[start : start + _CHUNK]))
    return digest.intdigest()


@functools.cache
def zeros_checksum(nbytes: int) -> int:
    """The checksum of ``nbytes`` zero bytes (a page that was never written)."""
    return xxhash.xxh3_64_intdigest(bytes(nbytes))


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
