"""Peak live tensor bytes on the CPU or on CUDA, with phase marks.

CUDA has allocator statistics (``max_memory_allocated``); the CPU has none, so there we
count storages: a dispatch mode sees every op's outputs, records each *new* storage (one
that is not the storage of an input, i.e. not a view or an in-place result) and a weakref
finalizer forgets it when it is freed. Both report bytes allocated since the tracker was
entered, so "peak" is the extra memory a region of code needed on top of what existed.

Example::

    with MemoryTracker() as mt:
        loss = model(x).sum()
        mt.mark("backward")
        loss.backward()
    print(mt.peak_bytes, mt.phase_peaks)   # {"forward": ..., "backward": ...}
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of a tracked region: its name, start time and peak bytes above baseline."""

    name: str
    start_s: float
    peak_bytes: int
    end_bytes: int


# CPU counters now active, told about memory that torch's allocator never sees (see
# external_allocated); a WeakSet, so a tracker dropped without __exit__ leaves nothing behind.
_ACTIVE: weakref.WeakSet[_StorageCounter] = weakref.WeakSet()


def external_allocated(key: object, nbytes: int) -> None:
    """Tell active CPU trackers that ``nbytes`` of tensor memory outside torch's allocator
    went live (e.g. a page entering a slab, a private mapping: ``tightfit.paging.slab``).

    Counted like a storage made in the tracked region: :func:`external_freed` with the same
    ``key`` subtracts it again; memory that went live before a tracker was entered is not
    counted by it, nor subtracted when freed.
    """
    for counter in list(_ACTIVE):
        counter.add_external(key, nbytes)


def external_freed(key: object) -> None:
    """The memory announced under ``key`` with :func:`external_allocated` is gone."""
    for counter in list(_ACTIVE):
        counter.drop_external(key)


_UNCOUNTED = threading.local()


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Tensors made inside (in this thread) are not counted by CPU trackers: for storages
    that are not RAM, such as a file mapping (tightfit's spill files are the disk tier)."""
    depth = getattr(_UNCOUNTED, "depth", 0)
    _UNCOUNTED.depth = depth + 1
    try:
        yield
    finally:
        _UNCOUNTED.depth = depth


class _StorageCounter(TorchDispatchMode):
    """Counts bytes of CPU storages allocated while the mode is active and still alive."""

    def __init__(self, on_change: Any) -> None:
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._external: dict[object, int] = {}
        self._lock = threading.Lock()
        self._on_change = on_change
        self.current = 0

    def __enter__(self) -> _StorageCounter:
        _ACTIVE.add(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.discard(self)
        super().__exit__(*exc)

    def _forget(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def add_external(self, key: object, nbytes: int) -> None:
        with self._lock:
            self._external[key] = self._external.get(key, 0) + nbytes
            self.current += nbytes
        self._on_change(self.current)

    def drop_external(self, key: object) -> None:
        with self._lock:
            self.current -= self._external.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(_UNCOUNTED, "depth", 0):
            return out
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and _has_storage(t)
        }
        grew = False
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not _has_storage(t):
                continue
            st = t.untyped_storage()
            if id(st) in inputs:
                continue  # a view or an in-place result: no new memory
            nbytes = st.nbytes()
            with self._lock:
                old = self._sizes.get(st)
                if old is None:
                    self._sizes[st] = nbytes
                    weakref.finalize(st, self._forget, nbytes)
                    self.current += nbytes
                    grew = True
        if grew:
            self._on_change(self.current)
        return out


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class MemoryTracker:
    """Measure peak live tensor bytes allocated inside a ``with`` block.

    Args:
        device: Device to measure. ``None`` means CUDA's current device when CUDA is
            available, else the CPU. On CUDA the figures come from the caching allocator's
            statistics; on the CPU from counting live storages (tensors only: memory that a
            C extension allocates outside torch is not seen unless it is announced with
            :func:`external_allocated`, as tightfit's CPU slabs do).

    Attributes:
        peak_bytes: Highest live bytes above the baseline seen so far.
        phase_peaks: Peak bytes above baseline per phase name (see :meth:`mark`).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"MemoryTracker measures 'cpu' or 'cuda' devices, got {self.device}; "
                "pass device='cpu' or a CUDA device."
            )
        self.peak_bytes = 0
        self.phases: list[PhaseRecord] = []
        self._phase_name = "forward"
        self._phase_start = 0.0
        self._phase_peak = 0
        self._baseline = 0
        self._mode: _StorageCounter | None = None
        self._active = False

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        if self._active:
            raise RuntimeError("MemoryTracker is already active; use a new tracker per region.")
        self._active = True
        self.peak_bytes = 0
        self.phases = []
        self._phase_start = time.perf_counter()
        self._phase_peak = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _StorageCounter(self._on_change)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_phase()
        if self._mode is not None:
            self._mode.__exit__(*exc)
        self._active = False

    # -- readings --------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        """Live bytes allocated since entering and not yet freed."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._baseline
        return self._mode.current if self._mode is not None else 0

    def _read_peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._baseline
        return self._phase_peak

    def _on_change(self, current: int) -> None:
        if current > self._phase_peak:
            self._phase_peak = current

    @property
    def phase_peaks(self) -> dict[str, int]:
        """Peak bytes above baseline per phase name (the current phase included); a name
        marked more than once gets the highest peak of its phases."""
        out: dict[str, int] = {}
        for p in self.phases:
            out[p.name] = max(out.get(p.name, 0), p.peak_bytes)
        if self._active:
            out[self._phase_name] = max(out.get(self._phase_name, 0), self._read_peak())
        return out

    def mark(self, phase: str) -> None:
        """End the current phase and start one called ``phase`` (e.g. "backward")."""
        if not self._active:
            raise RuntimeError("mark() is only valid inside the tracker's `with` block.")
        self._close_phase()
        self._phase_name = phase
        self._phase_start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            # after a reset the allocator's peak restarts at what is live now
        self._phase_peak = max(self.current_bytes, 0)

    def _close_phase(self) -> None:
        peak = max(self._read_peak(), 0)
        self.peak_bytes = max(self.peak_bytes, peak)
        self.phases.append(PhaseRecord(self._phase_name, self._phase_start, peak, self.current_bytes))
