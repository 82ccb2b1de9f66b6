"""A strict CPU emulation of CUDA: asynchronous streams, stream order, a caching allocator that
reuses memory at once, backward on another thread, and a count of host syncs.

The CUDA-path tests run under it (the ``strict_cuda`` fixture, ``tests/conftest.py``); the
device stays the CPU. What it does, as CUDA and torch do it:

* **streams**: the compute stream is the test's thread (its ops run at once, as a host that
  never waits would see them). A side stream (``torch.cuda.Stream()``) has a worker thread:
  its copies (``copy_``) are queued and run later, in stream order, after a random delay of
  up to ``jitter`` seconds; its other ops wait for the queue and run at once. An event
  recorded on a side stream is a place in its queue: ``Event.synchronize``/``query``, a
  stream's ``synchronize`` and ``torch.cuda.synchronize`` wait for (or ask about) it, and the
  compute stream's ``wait_event`` holds the test's thread until the copies before it are done
  (what the GPU would do to the kernels queued after it). A missing wait shows as wrong data.
* **stream order**: every stream has a vector clock, and every aten op of the test's threads
  is an operation of the current stream on the storages its schema says it reads and writes.
  An op that reads a storage last written on another stream, or writes one another stream
  used, must be ordered after that use (an event waited on, ``wait_stream``, a host sync);
* **allocator**: ``torch.empty`` on the device comes from :mod:`strict_alloc` (freed blocks
  poisoned and handed to the next request of the stream at once; ops' outputs still come
  from the CPU's allocator: for them only the rule is checked). A storage used on another
  stream must, when it is freed, have that use ordered before the allocating stream's
  position, or ``record_stream(that stream)`` called on it (torch's two ways);
* **backward** (``torch.autograd.backward``, hence ``Tensor.backward``) runs on a thread of
  its own, with the caller's dispatch modes, as CUDA's autograd device thread does;
* **host syncs** (:attr:`StrictCuda.syncs`, by kind): ``.item()`` and the implicit
  conversions, ``.tolist()``, data-dependent shapes (``nonzero``, ``equal``...),
  ``torch.cuda.synchronize``, a stream's or an event's ``synchronize``, and blocking copies
  (``.cpu()``/``.numpy()`` of a device tensor, a ``copy_`` between host memory and the
  device without ``non_blocking``). Only the test's threads count (a copy worker that waits
  for an event blocks no compute). A device tensor is one made under the emulation by an op
  or ``torch.empty`` of the test's threads (step counts included), the "pinned" ones
  excepted; host memory is pinned buffers and memory made otherwise (a spill map).

Violations are collected in :attr:`StrictCuda.violations` (the fixture fails a test that
leaves any). Streams and events are in ``strict_stream.py``. Pinned host memory is
``strict_pinned.py``'s (torch's power-of-two caching allocator and ``cudaHostRegister``,
installed with this: :attr:`StrictCuda.pinned_host`): CPU tensors remembered as pinned and
not tracked by the stream rules (the host allocator orders them by events itself); storages
made before the emulation starts are not tracked.

What it cannot show: the kernels' own launch behaviour (bitsandbytes' launches on the legacy
default stream are modelled by a test that runs them there; launch-time-only profiling),
real concurrency of the compute with the copies (the compute's ops run at once, its waits
block the host), and, the device being the CPU, host memory made with a plain
``torch.empty`` on the test's thread (it is device memory here).
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_leaves

from . import strict_pinned
from .strict_alloc import CachingAllocator
from .strict_stream import Clock, Event, Stream, _merge

aten = torch.ops.aten
_SYNCING_OPS = {aten._local_scalar_dense.default: "item", aten.equal.default: "equal",
                aten.is_nonzero.default: "item", aten.nonzero.default: "nonzero",
                aten.masked_select.default: "nonzero"}  # fmt: skip
_METADATA = {aten.set_.source_Storage_storage_offset, aten.set_.source_Storage,
             aten.set_.source_Tensor, aten.set_.default, aten.resize_.default}  # fmt: skip


@dataclass
class _Storage:
    stream: Stream  # allocated on
    label: str
    nbytes: int
    write: tuple[Stream, int] | None = None
    reads: dict[int, tuple[Stream, int]] = field(default_factory=dict)
    others: dict[int, tuple[Stream, int]] = field(default_factory=dict)  # last use per stream
    recorded: set[int] = field(default_factory=set)  # record_stream(stream) ids


class StrictCuda(TorchDispatchMode):
    """The emulation's state; active (as a dispatch mode) while the fixture is."""

    def __init__(self, jitter: float = 2e-4, seed: int = 0) -> None:
        super().__init__()
        self.jitter, self.rng = jitter, random.Random(seed)
        self.streams: list[Stream] = []
        self.host: Clock = {}
        self.violations: list[str] = []
        self.calls: list[tuple[str, ...]] = []  # ("wait_event"/"wait_stream", who, on whom)
        self.syncs: collections.Counter[str] = collections.Counter()
        self.sync_debug = "default"
        self.pinned: set[int] = set()
        self.allocator = CachingAllocator()
        self.pinned_host: strict_pinned.StrictPinned | None = None  # set by install()
        self.compute = Stream(self, "compute", worker=False)
        self._local = threading.local()
        self._live: dict[int, _Storage] = {}
        self._threads = {threading.get_ident()}  # the test's thread and its backward threads

    # -- streams -----------------------------------------------------------------------
    def current(self) -> Stream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def use(self, stream: Stream | None) -> Any:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def synchronize(self) -> None:
        self.count_sync("synchronize")
        for s in self.streams:
            if s.worker is not None:
                s.worker.wait_for(s.worker.queued)
            _merge(self.host, s.clock)
        self.raise_copy_errors()

    @contextlib.contextmanager
    def hold(self, stream: Stream) -> Any:
        """Inside, ``stream`` runs none of its queued work (a GPU busy elsewhere): copies
        queued meanwhile land after the block, whatever the test's thread did in between."""
        gate = threading.Event()
        stream.worker.submit(gate.wait)
        try:
            yield
        finally:
            gate.set()

    def raise_copy_errors(self) -> None:
        for s in self.streams:
            if s.worker is not None and s.worker.errors:
                raise s.worker.errors.pop(0)

    def close(self) -> None:
        """Let every queued copy run, stop the workers (the fixture's teardown)."""
        for s in self.streams:
            if s.worker is not None:
                s.worker.close()

    # -- host syncs --------------------------------------------------------------------
    def count_sync(self, kind: str) -> None:
        if threading.get_ident() not in self._threads:
            return
        self.syncs[kind] += 1
        if self.sync_debug == "error":  # torch.cuda.set_sync_debug_mode("error")
            raise RuntimeError(f"called a synchronizing CUDA operation ({kind})")
        if self.sync_debug == "warn":
            warnings.warn(f"called a synchronizing CUDA operation ({kind})", stacklevel=3)

    def set_sync_debug_mode(self, mode: int | str) -> None:
        """``torch.cuda.set_sync_debug_mode``: 0/"default", 1/"warn", 2/"error"."""
        names = {0: "default", 1: "warn", 2: "error"}
        self.sync_debug = names.get(mode, mode)  # type: ignore[call-overload]

    def allocated_bytes(self) -> int:
        """``torch.cuda.memory_allocated``: bytes of the device storages alive now (those
        made under the emulation)."""
        return sum(info.nbytes for info in list(self._live.values()))

    def sync_count(self) -> int:
        """Host syncs counted so far, all kinds."""
        return sum(self.syncs.values())

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on the emulated device: its storage was made under the emulation,
        by an op or ``torch.empty`` of the test's threads, and is not pinned. Host memory made
        otherwise (``torch.frombuffer`` over a spill map, a pinned buffer) is not."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse): not a plain read
            return False
        return st.data_ptr() not in self.pinned and id(st) in self._live

    # -- storages ----------------------------------------------------------------------
    def _info(self, t: torch.Tensor, new_ok: bool, stream: Stream, label: str) -> _Storage | None:
        st = t.untyped_storage()
        if st.data_ptr() in self.pinned or st.nbytes() == 0:
            return None
        info = self._live.get(id(st))
        if info is None and new_ok:
            info = self._live[id(st)] = _Storage(stream, label, st.nbytes())
            weakref.finalize(st, self._freed, id(st))
        return info

    def new_empty(self, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty`` on the device: a block of the current stream's pool."""
        stream = self.current()
        t = self.allocator.empty(size, dtype, stream)
        self._info(t, True, stream, f"torch.empty{tuple(size)}")
        return t

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        info = self._live.get(id(t.untyped_storage()))
        if info is not None:
            info.recorded.add(stream.id)
        self.calls.append(("record_stream", stream.name))

    def _freed(self, key: int) -> None:
        info = self._live.pop(key)
        alloc = info.stream
        waits = []
        for stream, op in info.others.values():
            if stream is alloc or alloc.ordered_after(stream, op):
                continue
            if stream.id in info.recorded:
                waits.append((stream, stream.ticket()))
                continue
            self.violations.append(
                f"{info.label}: allocated on {alloc.name}, used on {stream.name} (op {op}), "
                f"freed before {alloc.name} waited for that use and without "
                f"record_stream({stream.name}): its memory may be reused while in use")
        self.allocator.freed(key, waits)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if threading.get_ident() not in self._threads:
            return func(*args, **kwargs)
        stream = self.current()
        if func in _SYNCING_OPS and self.is_device(args[0]):
            self.count_sync(_SYNCING_OPS[func])
        deferred = func is aten.copy_.default and stream.worker is not None
        if deferred and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            deferred = False  # a blocking copy: in order, the host waits for it
        if not deferred and stream.worker is not None:
            stream.worker.wait_for(stream.worker.queued)  # stream order
        if func is aten.copy_.default and not kwargs.get("non_blocking",
                                                          args[2] if len(args) > 2 else False):
            self._count_blocking_copy(args[0], args[1])
        if deferred:
            dst, src = (self.allocator.view_of_block(t) for t in args[:2])
            stream.worker.submit(lambda: dst.copy_(src))
            out = args[0]
        else:
            out = func(*args, **kwargs)
        if func.is_view or func in _METADATA:  # no bytes read or written
            return out
        self._track(func, args, kwargs, out, stream)
        return out

    def _count_blocking_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.is_device(dst) != self.is_device(src):  # host <-> device
            self.count_sync("blocking copy")

    def _track(self, func: Any, args: tuple, kwargs: dict, out: Any, stream: Stream) -> None:
        op = stream.tick()
        writes: list[torch.Tensor] = []
        reads: list[torch.Tensor] = []
        schema = func._schema.arguments
        named = dict(kwargs)
        for i, a in enumerate(args):
            if i < len(schema):
                named[schema[i].name] = a
        for arg in schema:
            value = named.get(arg.name)
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            (writes if is_write else reads).extend(tensors)
        for t in reads:
            self._access(t, stream, op, write=False, func=func)
        for t in writes:
            self._access(t, stream, op, write=True, func=func)
        inputs = {id(t.untyped_storage()) for t in reads + writes}
        for t in tree_leaves(out):  # new storages (not views of an input's)
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                info = self._info(t, True, stream, f"{func} output")
                if info is not None and info.write is None:
                    info.write = (stream, op)
                    info.others[stream.id] = (stream, op)

    def _access(self, t: torch.Tensor, stream: Stream, op: int, write: bool, func: Any) -> None:
        info = self._info(t, False, stream, "")
        if info is None:
            return
        before = [info.write] if info.write else []
        if write:
            before += list(info.reads.values())
        for other, q in before:
            if not stream.ordered_after(other, q):
                kind = "writes" if write else "reads"
                self.violations.append(
                    f"{func} on {stream.name} {kind} {info.label} used on {other.name} (op {q}) "
                    f"without waiting for it")
        if write:
            info.write, info.reads = (stream, op), {}
        else:
            info.reads[stream.id] = (stream, op)
        info.others[stream.id] = (stream, op)

    # -- backward on its own thread ------------------------------------------------------
    def backward_on_thread(self, backward: Any) -> Any:
        """``torch.autograd.backward`` run on a new thread with the caller's dispatch modes
        and grad mode, as CUDA's autograd device thread runs it; errors re-raised here."""

        def run(*args: Any, **kwargs: Any) -> None:
            modes, grad = _get_current_dispatch_mode_stack(), torch.is_grad_enabled()
            box: list[BaseException] = []

            def body() -> None:
                self._threads.add(threading.get_ident())
                for m in modes:
                    _push_mode(m)
                try:
                    with torch.set_grad_enabled(grad):
                        backward(*args, **kwargs)
                except BaseException as exc:
                    box.append(exc)
                finally:
                    for _ in modes:
                        _pop_mode()
                    self._threads.discard(threading.get_ident())

            thread = threading.Thread(target=body, name="strict-backward")
            thread.start()
            thread.join()
            if box:
                raise box[0]

        return run


def install(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> StrictCuda:
    """Patch torch.cuda's streams, events, synchronize, pinned memory (with
    ``tests/tiers/strict_pinned.py``), ``record_stream``, ``torch.empty``, the host reads and
    ``torch.autograd.backward`` with the strict emulation and start it; the caller ends it
    with :func:`uninstall` (the fixture)."""
    emu = StrictCuda(**kwargs)
    Event.emu = emu
    empty, tolist, cpu, numpy = torch.empty, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy

    def fake_empty(*size, pin_memory: bool = False, **kw):  # noqa: ANN002, ANN003, ANN202
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        # the device asked for, else the default one (transformers builds models under
        # ``with torch.device("meta")``: those stay torch's)
        device = kw.get("device") or torch.get_default_device()
        plain = set(kw) <= {"dtype", "device"} and torch.device(device).type == "cpu"
        if (not pin_memory and plain and threading.get_ident() in emu._threads
                and all(isinstance(n, int) for n in shape) and 0 not in shape and shape):
            return emu.new_empty(shape, kw.get("dtype") or torch.get_default_dtype())
        t = empty(*size, **kw)
        if pin_memory:
            emu.pinned.add(t.untyped_storage().data_ptr())
        return t

    def read(method: Any, kind: str) -> Any:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if emu.is_device(self):
                emu.count_sync(kind)
            return method(self, *a, **k)
        return counted

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "tolist", read(tolist, "tolist"))
    monkeypatch.setattr(torch.Tensor, "cpu", read(cpu, "blocking copy"))
    monkeypatch.setattr(torch.Tensor, "numpy", read(numpy, "blocking copy"))
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr() in emu.pinned)  # fmt: skip
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: emu.record_stream(self, s))
    class SideStream(Stream):  # a class, as torch.cuda.Stream is (annotations use it)
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(emu, f"side{len(emu.streams)}")

    monkeypatch.setattr(torch.cuda, "Stream", SideStream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", emu.use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: emu.current())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: emu.compute)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: emu.synchronize())
    monkeypatch.setattr(torch.autograd, "backward", emu.backward_on_thread(torch.autograd.backward))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", emu.set_sync_debug_mode)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: emu.allocated_bytes())
    # pinned memory as torch and cudaHostRegister pin it (power-of-two rounding, caching,
    # registered ranges): tests/tiers/strict_pinned.py, alongside this emulation
    emu.pinned_host = strict_pinned.install(monkeypatch, cuda=emu)
    emu.__enter__()
    return emu


def uninstall(emu: StrictCuda) -> None:
    emu.__exit__(None, None, None)
    emu.close()
