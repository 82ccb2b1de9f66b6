"""The strict CUDA emulation's streams and events (``tests/tiers/strict_cuda.py``).

A :class:`Stream` has a vector clock (which ops of every stream are ordered before its next
one) and, off the compute stream, a worker thread that runs its queued copies later, in
order, after a random delay (``_Worker``). An :class:`Event` is a recorded clock and a place
in the recording stream's queue: waiting on it, or synchronizing it, waits for the copies
queued before it.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .strict_cuda import StrictCuda

Clock = dict[int, int]  # stream id -> ops of that stream ordered before


class _Worker:
    """A side stream's device: runs its queued work in order, each after a random delay."""

    def __init__(self, name: str, jitter: float, rng: random.Random) -> None:
        self._cond = threading.Condition()
        self._tasks: collections.deque = collections.deque()
        self.queued = self.finished = 0
        self.errors: list[BaseException] = []
        self._jitter, self._rng, self._closed = jitter, rng, False
        self._thread = threading.Thread(target=self._run, name=f"strict-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Any) -> int:
        with self._cond:
            self._tasks.append(fn)
            self.queued += 1
            self._cond.notify_all()
            return self.queued

    def done(self, ticket: int) -> bool:
        return self.finished >= ticket

    def wait_for(self, ticket: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.finished >= ticket)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._tasks or self._closed)
                if not self._tasks:
                    return
                fn = self._tasks[0]
            time.sleep(self._rng.uniform(0, self._jitter))
            try:
                fn()
            except BaseException as exc:  # reported by the emulation at the next sync
                self.errors.append(exc)
            with self._cond:
                self._tasks.popleft()
                self.finished += 1
                self._cond.notify_all()


class Stream:
    """A fake CUDA stream with a vector clock (and, off the compute stream, a worker)."""

    _ids = 0

    def __init__(self, emu: StrictCuda, name: str, worker: bool = True) -> None:
        Stream._ids += 1
        self.id, self.name, self.emu = Stream._ids, name, emu
        self.clock: Clock = {self.id: 0}
        self.worker = _Worker(name, emu.jitter, emu.rng) if worker else None
        emu.streams.append(self)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def tick(self) -> int:
        _merge(self.clock, self.emu.host)
        self.clock[self.id] += 1
        return self.clock[self.id]

    def ticket(self) -> int:
        return self.worker.queued if self.worker else 0

    def done(self, ticket: int) -> bool:
        return self.worker is None or self.worker.done(ticket)

    def ordered_after(self, stream: Stream, op: int) -> bool:
        _merge(self.clock, self.emu.host)
        return stream is self or self.clock.get(stream.id, 0) >= op

    def wait_event(self, event: Event) -> None:
        assert event.snap is not None, "a stream waited on an event that was never recorded"
        self.emu.calls.append(("wait_event", self.name, event.stream.name))
        self._wait(event.stream, event.ticket)
        _merge(self.clock, event.snap)

    def wait_stream(self, stream: Stream) -> None:
        self.emu.calls.append(("wait_stream", self.name, stream.name))
        self._wait(stream, stream.ticket())
        _merge(self.clock, stream.clock)

    def _wait(self, other: Stream, ticket: int) -> None:
        if other.worker is None or other is self:
            return  # the compute's work is done when it is queued
        if self.worker is None:  # the compute's later kernels run after it: hold them
            other.worker.wait_for(ticket)
        else:
            self.worker.submit(lambda: other.worker.wait_for(ticket))

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.emu.count_sync("stream.synchronize")
        if self.worker is not None:
            self.worker.wait_for(self.worker.queued)
        _merge(self.emu.host, self.clock)

    def query(self) -> bool:
        return self.done(self.ticket())


class Event:
    """A fake CUDA event: the recording stream's clock and queue place when recorded."""

    emu: StrictCuda

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.snap: Clock | None = None
        self.stream: Stream | None = None
        self.ticket = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.emu.current()
        self.stream, self.snap, self.ticket = stream, dict(stream.clock), stream.ticket()

    def synchronize(self) -> None:
        assert self.snap is not None, "waited on an event that was never recorded"
        self.emu.count_sync("event.synchronize")
        if self.stream.worker is not None:
            self.stream.worker.wait_for(self.ticket)
        _merge(self.emu.host, self.snap)

    def query(self) -> bool:
        return self.snap is None or self.stream.done(self.ticket)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.emu.current()).wait_event(self)


def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
