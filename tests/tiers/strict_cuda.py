"""A stricter CPU emulation of CUDA streams: stream order and the caching allocator's rule.

``tests/conftest.py::fake_cuda`` only checks that an event is recorded before it is waited
on. Here every stream has a vector clock, and every aten op run on the test's thread is an
operation of the current stream (``torch.cuda.stream(s)`` switches it) on the storages it
reads and writes (its schema says which). Two rules are checked, as CUDA and torch's caching
allocator impose them:

* **stream order**: an op that reads a storage last written on another stream, or writes one
  another stream read or wrote, must be ordered after that access (an event waited on,
  ``wait_stream``, or a host sync in between) — else the two may overlap on a GPU;
* **allocator**: memory is handed out again, in the order of the stream that allocated it, as
  soon as it is freed. A storage used on another stream must, when it is freed, have that use
  ordered before the allocating stream's position, or ``record_stream(that stream)`` called
  on it (torch's two ways: "a sync from that stream back to the creation stream, or
  record_stream").

Violations are collected in :attr:`StrictCuda.violations` (a test asserts it empty). Copies
still run at once (on the CPU); the device is the CPU; "pinned" buffers are CPU tensors
remembered as pinned and not tracked (the host allocator orders them by events itself).
Storages made before the emulation starts, or off the test's thread (the copy worker), are
not tracked.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Clock = dict[int, int]  # stream id -> ops of that stream ordered before


class Stream:
    """A fake CUDA stream with a vector clock."""

    _ids = 0

    def __init__(self, emu: StrictCuda, name: str) -> None:
        Stream._ids += 1
        self.id, self.name, self.emu = Stream._ids, name, emu
        self.clock: Clock = {self.id: 0}
        emu.streams.append(self)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def tick(self) -> int:
        _merge(self.clock, self.emu.host)
        self.clock[self.id] += 1
        return self.clock[self.id]

    def ordered_after(self, stream: Stream, op: int) -> bool:
        _merge(self.clock, self.emu.host)
        return stream is self or self.clock.get(stream.id, 0) >= op

    def wait_event(self, event: Event) -> None:
        assert event.snap is not None, "a stream waited on an event that was never recorded"
        self.emu.calls.append(("wait_event", self.name, event.stream.name))
        _merge(self.clock, event.snap)

    def wait_stream(self, stream: Stream) -> None:
        self.emu.calls.append(("wait_stream", self.name, stream.name))
        _merge(self.clock, stream.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _merge(self.emu.host, self.clock)

    def query(self) -> bool:
        return True


class Event:
    """A fake CUDA event: the recording stream's clock when it was recorded."""

    emu: StrictCuda

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.snap: Clock | None = None
        self.stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.emu.current()
        self.stream, self.snap = stream, dict(stream.clock)

    def synchronize(self) -> None:
        assert self.snap is not None, "waited on an event that was never recorded"
        _merge(self.emu.host, self.snap)

    def query(self) -> bool:
        return True

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.emu.current()).wait_event(self)


def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass
class _Storage:
    stream: Stream  # allocated on
    label: str
    write: tuple[Stream, int] | None = None
    reads: dict[int, tuple[Stream, int]] = field(default_factory=dict)
    others: dict[int, tuple[Stream, int]] = field(default_factory=dict)  # last use per stream
    recorded: set[int] = field(default_factory=set)  # record_stream(stream) ids


_METADATA = {torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.source_Storage,
             torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default,
             torch.ops.aten.resize_.default}


class StrictCuda(TorchDispatchMode):
    """The emulation's state; active (as a dispatch mode) while the fixture is."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[Stream] = []
        self.host: Clock = {}
        self.violations: list[str] = []
        self.calls: list[tuple[str, ...]] = []  # ("wait_event"/"wait_stream", who, on whom)
        self.pinned: set[int] = set()
        self.compute = Stream(self, "compute")
        self._local = threading.local()
        self._live: dict[int, _Storage] = {}
        self._thread = threading.get_ident()

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
        for s in self.streams:
            _merge(self.host, s.clock)

    # -- storages ----------------------------------------------------------------------
    def _info(self, t: torch.Tensor, new_ok: bool, stream: Stream, label: str) -> _Storage | None:
        st = t.untyped_storage()
        if st.data_ptr() in self.pinned or st.nbytes() == 0:
            return None
        info = self._live.get(id(st))
        if info is None and new_ok:
            info = self._live[id(st)] = _Storage(stream, label)
            weakref.finalize(st, self._freed, id(st))
        return info

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        info = self._live.get(id(t.untyped_storage()))
        if info is not None:
            info.recorded.add(stream.id)
        self.calls.append(("record_stream", stream.name))

    def _freed(self, key: int) -> None:
        info = self._live.pop(key)
        alloc = info.stream
        for stream, op in info.others.values():
            if stream is alloc or stream.id in info.recorded or alloc.ordered_after(stream, op):
                continue
            self.violations.append(
                f"{info.label}: allocated on {alloc.name}, used on {stream.name} (op {op}), "
                f"freed before {alloc.name} waited for that use and without "
                f"record_stream({stream.name}): its memory may be reused while in use")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if threading.get_ident() != self._thread:
            return out
        if func.is_view or func in _METADATA:  # no bytes read or written
            return out
        stream = self.current()
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
        return out

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


def install(monkeypatch: pytest.MonkeyPatch) -> StrictCuda:
    """Patch torch.cuda's streams, events, pinned memory and ``record_stream`` with the strict
    emulation and start tracking; the caller exits it with :func:`uninstall` (the fixture)."""
    emu = StrictCuda()
    Event.emu = emu
    empty = torch.empty

    def fake_empty(*args, pin_memory: bool = False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = empty(*args, **kwargs)
        if pin_memory:
            emu.pinned.add(t.untyped_storage().data_ptr())
        return t

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr() in emu.pinned)  # fmt: skip
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: emu.record_stream(self, s))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream(emu, f"side{len(emu.streams)}"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", emu.use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: emu.current())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: emu.synchronize())
    emu.__enter__()
    return emu


def uninstall(emu: StrictCuda) -> None:
    emu.__exit__(None, None, None)
