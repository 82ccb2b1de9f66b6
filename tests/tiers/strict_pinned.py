"""Pinned host memory as torch 2.13 and CUDA pin it, emulated on the CPU: what is really pinned.

Two ways to pin, both counted in bytes really locked:

* torch's ``CachingHostAllocator`` (``torch.empty(..., pin_memory=True)``,
  ``ATen/core/CachingHostAllocator.h``): a request is rounded up to a power of two
  (``PowerOf2Ceil``: the default ``pinned_max_round_threshold`` is ``SIZE_MAX``), served from
  a cached free block of that size when there is one, and a freed block goes back to the
  cache, still pinned, until ``torch.accelerator.empty_host_cache()`` (or
  ``torch._C._host_emptyCache()``) frees the idle ones;
* ``torch.cuda.cudart().cudaHostRegister(ptr, size, flags)`` / ``cudaHostUnregister(ptr)``:
  exactly ``size`` bytes locked until unregistered. Unregistering memory that was never
  registered, or while a copy may still run (no device sync since the last registration or
  copy-using call when a strict CUDA emulation is given), is a violation.

``is_pinned()`` is true for the allocator's blocks and for tensors whose storage starts in a
registered range. Usable alone or alongside ``tests/tiers/strict_cuda.py`` (pass its
:class:`StrictCuda` as ``cuda``: pinned storages are then also in its ``pinned`` set, so its
stream tracking treats them as host memory, and its streams must be synchronized before a
registered range is unlocked). Memory itself is ordinary CPU memory: only the accounting and
the rules are emulated, not the reuse of a block's bytes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


def power_of_two(nbytes: int) -> int:
    """torch's ``PowerOf2Ceil``."""
    return 1 << (max(int(nbytes), 1) - 1).bit_length()


class _Error(int):
    """A stand-in for ``torch.cuda.cudart().cudaError`` values."""


class _CudaError:
    success = _Error(0)
    memory_allocation = _Error(2)


@dataclass
class StrictPinned:
    """The emulation's state: the allocator's blocks, the registered ranges, the violations.

    Attributes:
        cached: Bytes of idle blocks the allocator keeps pinned, per block size.
        active_bytes: Bytes of the allocator's blocks handed out now.
        registered: Registered ranges, start pointer -> bytes.
        violations: Rule breaks (the fixture asserts none are left).
        fail_register: The next this many ``cudaHostRegister`` calls fail.
        peak_pinned_bytes: The most bytes pinned at once.
    """

    cuda: Any = None
    cached: dict[int, int] = field(default_factory=dict)  # size -> idle blocks
    active_bytes: int = 0
    registered: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    fail_register: int = 0
    peak_pinned_bytes: int = 0
    requests: list[int] = field(default_factory=list)  # torch allocator request sizes
    registrations: int = 0  # successful cudaHostRegister calls
    _ptrs: set[int] = field(default_factory=set)

    @property
    def allocator_bytes(self) -> int:
        """Bytes the caching allocator holds pinned: handed out plus cached."""
        return self.active_bytes + sum(s * n for s, n in self.cached.items())

    @property
    def registered_bytes(self) -> int:
        return sum(self.registered.values())

    @property
    def pinned_bytes(self) -> int:
        """Every byte pinned now, whichever way."""
        return self.allocator_bytes + self.registered_bytes

    def _peak(self) -> None:
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    # -- torch's caching host allocator ---------------------------------------------------
    def allocate(self, t: torch.Tensor, nbytes: int) -> None:
        size = power_of_two(nbytes)
        self.requests.append(nbytes)
        if self.cached.get(size):
            self.cached[size] -= 1  # a cached block of the size class: nothing new pinned
        self.active_bytes += size
        self._peak()
        st = t.untyped_storage()
        self._mark(st.data_ptr())
        weakref.finalize(st, self._freed, size, st.data_ptr())

    def _freed(self, size: int, ptr: int) -> None:
        self.active_bytes -= size
        self.cached[size] = self.cached.get(size, 0) + 1  # still pinned, in the cache
        self._unmark(ptr)

    def empty_cache(self) -> None:
        self.cached.clear()

    # -- cudaHostRegister -----------------------------------------------------------------
    def register(self, ptr: int, size: int, flags: int) -> _Error:
        if self.fail_register:
            self.fail_register -= 1
            return _CudaError.memory_allocation
        if any(p <= ptr < p + n for p, n in self.registered.items()):
            self.violations.append(f"cudaHostRegister of {ptr:#x}: already registered")
        self.registered[ptr] = int(size)
        self.registrations += 1
        self._mark(ptr)
        self._peak()
        return _CudaError.success

    def unregister(self, ptr: int) -> _Error:
        if ptr not in self.registered:
            self.violations.append(f"cudaHostUnregister of {ptr:#x}: not registered")
            return _CudaError.memory_allocation
        if self.cuda is not None and not _streams_done(self.cuda):
            self.violations.append(f"cudaHostUnregister of {ptr:#x} while a stream may still "
                                   "copy (no device sync before it)")
        del self.registered[ptr]
        self._unmark(ptr)
        return _CudaError.success

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._ptrs

    def _mark(self, ptr: int) -> None:
        self._ptrs.add(ptr)
        if self.cuda is not None:
            self.cuda.pinned.add(ptr)

    def _unmark(self, ptr: int) -> None:
        self._ptrs.discard(ptr)
        if self.cuda is not None:
            self.cuda.pinned.discard(ptr)


def _streams_done(cuda: Any) -> bool:
    """Every stream of a StrictCuda emulation ordered before the host (synchronized)."""
    host = getattr(cuda, "host", None)
    streams = getattr(cuda, "streams", None)
    if host is None or streams is None:
        return True
    return all(host.get(s.id, 0) >= s.clock.get(s.id, 0) for s in streams)


class _Cudart:
    def __init__(self, emu: StrictPinned) -> None:
        self.cudaError = _CudaError
        self._emu = emu

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> _Error:  # noqa: N802
        return self._emu.register(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> _Error:  # noqa: N802
        return self._emu.unregister(ptr)

    def cudaGetErrorString(self, err: _Error) -> str:  # noqa: N802
        return "out of memory" if err else "no error"


def install(monkeypatch: pytest.MonkeyPatch, cuda: Any = None) -> StrictPinned:
    """Patch torch's pinned allocation (``torch.empty(pin_memory=True)``), ``is_pinned``,
    ``torch.cuda.cudart()`` and the host-cache emptying with the emulation. ``cuda``: a
    :class:`tests.tiers.strict_cuda.StrictCuda` already installed, to work alongside it."""
    emu = StrictPinned(cuda=cuda)
    empty = torch.empty  # strict_cuda's when it is installed: it then sees the pinned ones
    was_pinned = torch.Tensor.is_pinned

    def fake_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if not pin_memory:
            return empty(*args, **kwargs)
        t = empty(*args, pin_memory=True, **kwargs) if cuda is not None else empty(*args, **kwargs)
        emu.allocate(t, t.untyped_storage().nbytes())
        return t

    def is_pinned(self: torch.Tensor, *a: Any) -> bool:
        return emu.is_pinned(self) or (cuda is not None and was_pinned(self, *a))

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(emu))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", emu.empty_cache)
    monkeypatch.setattr(torch._C, "_host_emptyCache", emu.empty_cache, raising=False)
    if cuda is None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return emu


@pytest.fixture
def strict_pinned(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """The emulation for one test (alongside ``strict_cuda`` when the test uses it); the test
    fails if it leaves a violation. Import it into a test module to use it."""
    cuda = request.getfixturevalue("strict_cuda") if "strict_cuda" in request.fixturenames else None
    emu = install(monkeypatch, cuda)
    yield emu
    assert emu.violations == [], "\n".join(emu.violations)
