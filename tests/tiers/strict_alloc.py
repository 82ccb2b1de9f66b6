"""The strict emulation's device allocator: stream-ordered, caching, reusing a block at once.

torch's CUDA caching allocator keeps freed blocks per stream and hands one to the next request
on that stream at once: kernels queued on that stream come after the free, so they are safe,
but a copy another stream still runs on the old tensor now shares its memory with the new
one. torch's two protections are ``record_stream(other)`` (the block waits for the other
stream's work queued so far) and ordering the allocating stream after the use (an event it
waited on) before the free.

Here ``torch.empty`` on the emulated device (the CPU) returns a tensor over a block this
allocator owns (never freed while it lives), through a storage of its own that does not own
the memory: when that storage dies (the tensor, its views and every ``set_`` of its storage
are gone), the block is free. A freed block is filled with poison (0xFF bytes: NaN in every
float dtype) and handed to the next request of the same stream, unless ``record_stream``
holds it back until the recorded streams' queued work is done. A copy still queued on a side
stream (the emulated streams run their copies later, ``strict_cuda``) writes through a view
of the block itself, so an unprotected free shows as poisoned or clobbered values, as on a
GPU, besides the violation the stream clocks report.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tightfit.measure.tracker import external_allocated, external_freed

POISON = 0xFF
ROUND = 512  # CUDA's allocator rounds requests to 512 bytes


@dataclass
class Block:
    """Memory the allocator owns; ``waits`` are (stream, ticket) pairs that must complete
    before it is handed out again (``record_stream``)."""

    buf: torch.Tensor  # uint8, owned here
    stream: Any
    free: bool = False
    waits: list[tuple[Any, int]] = field(default_factory=list)


class CachingAllocator:
    """Blocks by stream; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: list[Block] = []
        self._by_storage: dict[int, Block] = {}  # id(user storage) -> its block
        self.reused = 0  # requests served from a freed block (a test can see reuse happen)

    def empty(self, size: tuple[int, ...], dtype: torch.dtype, stream: Any) -> torch.Tensor:
        """A new contiguous tensor on ``stream``'s pool (uninitialized: poison)."""
        numel = 1
        for n in size:
            numel *= n
        nbytes = numel * dtype.itemsize
        strides, step = [], 1
        for n in reversed(size):
            strides.insert(0, step)
            step *= max(n, 1)
        with _disable_current_modes():  # the allocator's own tensors are no op of the test
            block = self._take(nbytes, stream)
            raw = (ctypes.c_char * block.buf.numel()).from_address(block.buf.data_ptr())
            alias = torch.frombuffer(raw, dtype=torch.uint8)  # shares the block, owns nothing
            t = torch.empty(0, dtype=dtype).set_(alias.untyped_storage(), 0, size, strides)
        st = t.untyped_storage()
        with self._lock:
            self._by_storage[id(st)] = block
        external_allocated(("strict-alloc", id(st)), nbytes)  # CPU trackers count it
        return t

    def block_of(self, st: torch.UntypedStorage) -> Block | None:
        """The block a user storage lives in (None: torch's own allocator made it)."""
        return self._by_storage.get(id(st))

    def view_of_block(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` re-made over its block's own storage (so a queued copy keeps the memory,
        not the user's storage, alive); ``t`` itself when it is not in a block."""
        block = self.block_of(t.untyped_storage())
        if block is None:
            return t
        with _disable_current_modes():
            out = torch.empty(0, dtype=t.dtype)
            return out.set_(block.buf.untyped_storage(), t.storage_offset(), t.size(),
                            t.stride())

    def freed(self, key: int, waits: list[tuple[Any, int]]) -> bool:
        """The user storage ``key`` died; ``waits``: the recorded streams' tickets now.
        Returns whether it was one of this allocator's blocks."""
        with self._lock:
            block = self._by_storage.pop(key, None)
            if block is None:
                return False
            block.waits = waits
            if not waits:
                _poison(block)
            block.free = True
        external_freed(("strict-alloc", key))
        return True

    def _take(self, nbytes: int, stream: Any) -> Block:
        with self._lock:
            best = None
            for b in self._blocks:
                if not b.free or b.stream is not stream or b.buf.numel() < nbytes:
                    continue
                if b.waits and not all(s.done(ticket) for s, ticket in b.waits):
                    continue  # record_stream: the other stream still uses it
                if best is None or b.buf.numel() < best.buf.numel():
                    best = b
            if best is not None:
                if best.waits:
                    _poison(best)
                best.free, best.waits = False, []
                self.reused += 1
                return best
            size = max(ROUND, -(-nbytes // ROUND) * ROUND)
            block = Block(torch.full((size,), POISON, dtype=torch.uint8), stream)  # no modes
            self._blocks.append(block)
            return block


def _poison(block: Block) -> None:
    with _disable_current_modes():
        block.buf.fill_(POISON)
