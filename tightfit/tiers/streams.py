"""The copy engines' side streams: one dedicated CUDA stream per device and role.

See :func:`copy_stream` for why tightfit does not draw its copy streams from torch's pool;
:func:`stall_seconds` times how long the compute stream stood waiting for a copy;
:class:`StagedLoad` is a staged (disk) load whose H2D goes on a side stream once its read lands.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream


def copy_stream(device: torch.device, name: str) -> torch.cuda.Stream:
    """The side stream of role ``name`` on ``device``: a dedicated one, made once per process.

    ``torch.cuda.Stream()`` hands out torch's pool of 32 streams per device round robin, so
    a copy stream drawn anew for each engine (every re-plan made one) sooner or later is the
    stream NCCL or FSDP2 drew, and copies queue behind collectives. A dedicated stream is made
    with ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` from the CUDA runtime torch
    loaded (found in ``/proc/self/maps``) and wrapped in ``torch.cuda.ExternalStream``; it is
    never destroyed (the caching allocator may still associate blocks with it). Where that
    runtime cannot be found (not Linux, a static build), the stream comes from torch's pool,
    as before.
    """
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    handle = _dedicated_stream(index)
    if handle is None:
        return torch.cuda.Stream(device)
    with _STREAMS_LOCK:
        key = (index, name)
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.ExternalStream(handle(), device=torch.device("cuda", index))
        return _STREAMS[key]


def _dedicated_stream(index: int) -> Callable[[], int] | None:
    """A maker of new non-blocking streams on device ``index`` (``None``: no runtime found)."""
    runtime = _cuda_runtime()
    if runtime is None:
        return None

    def make() -> int:
        out = ctypes.c_void_p()
        with torch.cuda.device(index):
            err = runtime.cudaStreamCreateWithFlags(ctypes.byref(out), _NON_BLOCKING)
        if err != 0:
            raise RuntimeError(f"cudaStreamCreateWithFlags failed with CUDA error {err} on "
                               f"cuda:{index}")
        return int(out.value or 0)

    return make


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    if not torch.cuda.is_available():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libcudart.so"):
            with contextlib.suppress(OSError, AttributeError):
                runtime = ctypes.CDLL(path)
                runtime.cudaStreamCreateWithFlags.restype = ctypes.c_int
                runtime.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                                              ctypes.c_uint]
                return runtime
    return None


def timing_event() -> object:
    """A CUDA event that records its time (``elapsed_time``)."""
    return torch.cuda.Event(enable_timing=True)


def stall_seconds(arrived: object, done: object) -> float:
    """How long after the compute stream reached a wait its copy completed (0 when the copy
    was done first): ``elapsed_time`` of two completed timing events."""
    elapsed = getattr(arrived, "elapsed_time", None)
    if elapsed is None:  # events that do not time (an emulation's)
        return 0.0
    return max(0.0, float(elapsed(done))) / 1000.0


class StagedLoad:
    """A staged load: the worker's read into ``staging``, then (once) the H2D into ``slot``
    on the side stream after ``ready`` (the compute that last used the slot)."""

    __slots__ = ("task", "staging", "slot", "ready", "done")

    def __init__(self, task: Any, staging: torch.Tensor, slot: torch.Tensor,  # task: CopyTask
                 ready: object) -> None:
        self.task, self.staging, self.slot, self.ready = task, staging, slot, ready
        self.done: object | None = None

    def issue(self, stream: object) -> None:
        if self.done is not None or self.task.error is not None:
            return  # queued already; a failed read is raised by its wait()
        stream.wait_event(self.ready)  # type: ignore[attr-defined]
        with torch.cuda.stream(stream):
            self.slot.copy_(self.staging, non_blocking=True)
            done = timing_event()
            done.record(stream)  # type: ignore[arg-type]
        self.done = done
