"""Engines that move bytes between a tier's buffer and the device.

Copies between a home (host buffer or spill map) and a device *slot* go through a
:class:`CopyEngine`: a worker thread for memory copies that touch the spill map (page faults
block the thread doing the copy, not the compute), and on CUDA a side stream with events for
host↔device, so the compute never waits on the host and nothing synchronizes per tensor. The
paged optimizers' pages and offloaded activations move through the same engines.

The tiers: device = the params' device (``cuda:N``, or the CPU when there is no accelerator);
host = CPU RAM, pinned when the device is CUDA (on the CPU, device and host are one place);
disk = :class:`tightfit.tiers.spill.SpillArea`.

A home is a tensor (a host buffer, a spill-map view) or a :class:`Home`: an object that does its
own reads and writes (a spill-file page that checks its file and its checksum on the way).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch

from tightfit.tiers import pinned
from tightfit.tiers.copy_queue import CopyQueue, CopyTask
from tightfit.tiers.pinned import PinnedBuffer, PinnedHost
from tightfit.tiers.streams import StagedLoad, copy_stream, stall_seconds, timing_event


@runtime_checkable
class Home(Protocol):
    """A home that copies its bytes itself (run on the copy worker, so checks overlap)."""

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the home's bytes into ``dst`` (CPU memory); raise if they are not intact."""

    def write_from(self, src: torch.Tensor) -> None:
        """Make ``src`` (CPU memory) the home's bytes."""


def read_home(home: torch.Tensor | Home, dst: torch.Tensor) -> None:
    """Copy a home's bytes into ``dst``."""
    if isinstance(home, torch.Tensor):
        dst.copy_(home)
    else:
        home.read_into(dst)


def write_home(home: torch.Tensor | Home, src: torch.Tensor) -> None:
    """Copy ``src`` into a home."""
    if isinstance(home, torch.Tensor):
        home.copy_(src)
    else:
        home.write_from(src)


def _pinned(home: torch.Tensor | Home) -> bool:
    return isinstance(home, torch.Tensor) and home.is_pinned()


class CopyEngine:
    """Asynchronous copies between page homes and device slots (CPU version: a copy queue).

    Each slot alternates load → update → store, and the queue runs copies in order, so a slot
    is never refilled before its previous page was written back.
    """

    _help_queue = True  # the waiting thread may run queued copies (CopyQueue's help_waiters)

    def __init__(self) -> None:
        self._pool = CopyQueue(help_waiters=self._help_queue)
        self._pending: list[CopyTask] = []

    def load(self, home: torch.Tensor | Home, slot: torch.Tensor) -> object:
        """Start copying a page's bytes from its home into a device slot; returns a handle."""
        return self._pool.submit(read_home, home, slot)

    def wait(self, handle: object) -> float:
        """Make the slot usable by the update; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        handle.result()  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    def store(self, slot: torch.Tensor, home: torch.Tensor | Home) -> None:
        """Start writing an updated slot back to the page's home."""
        self._pending.append(self._pool.submit(write_home, home, slot))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` now, in the caller's order (the moves between tiers that
        happen between steps, where nothing is left to overlap with: see ``PageStore``)."""
        dst.copy_(src)

    # -- one-way moves of bytes that live on one tier at a time (offloaded activations) ----
    def offload(self, src: torch.Tensor, home: torch.Tensor) -> object:
        """Start moving ``src`` (bytes on the device) out to ``home`` (a region of the next
        tier). Keep ``src`` alive until :meth:`retire`.

        Returns:
            A handle for :meth:`retire`.
        """
        return self._pool.submit(home.copy_, src)

    def retire(self, handle: object) -> float:
        """Return once an :meth:`offload` can no longer read its source, so the source's
        memory may be reused; returns the seconds the caller was blocked."""
        return self.wait(handle)

    def fetch(self, home: torch.Tensor, dst: torch.Tensor) -> object:
        """Start copying ``home`` back into ``dst`` (device memory just allocated for it);
        :meth:`wait` makes ``dst`` usable."""
        return self._pool.submit(dst.copy_, home)

    def forget(self, handle: object) -> None:
        """An :meth:`offload` or :meth:`fetch` whose tensor is dropped before its
        :meth:`retire` or :meth:`wait` (an offloaded activation that died unread): make its
        memory safe to reuse. Here nothing to do: the queued copy holds its tensors."""

    def then(self, fn: Callable[[], object]) -> CopyTask:
        """Run ``fn`` on the copy thread once the copies queued so far are done (the disk
        tier hands written pages back to the OS there); ``.result()`` waits for it."""
        return self._pool.submit(fn)

    def drain(self) -> float:
        """Wait for every write-back (re-raising a failed one); returns seconds blocked.

        A write-back leaves the list only once it has run, so a drain that is interrupted
        leaves the rest for the next one to wait for (and to report).
        """
        t0 = time.perf_counter()
        errors = []
        while self._pending:
            try:
                self._pending[0].result()
            except BaseException as exc:  # wait for all of them, then report the first
                errors.append(exc)
            if self._pending[0].done:
                self._pending.pop(0)
            else:  # interrupted while waiting (the task still runs): keep it, stop here
                raise errors[-1]
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        """Make all copies visible to the host (before reading homes on the CPU)."""
        self.drain()

    def close(self) -> None:
        """Finish outstanding copies and stop the worker."""
        try:
            self.drain()
        finally:
            self._pool.close()

    def slots_freed(self) -> None:
        """The window slots are about to be freed (the caller synchronized first)."""

    @contextlib.contextmanager
    def beside_copies(self, copy_threads: int) -> Iterator[None]:
        """Run the block (an update beside this engine's copies) on torch's intra-op threads
        less ``copy_threads``, at least one, if a copy is queued or running as it starts
        (the thread that runs the block is the one that queues copies, so none starts
        during it otherwise); restored on the way out, raised or not.

        On the CPU the update and the copies share the cores. An OpenMP team that takes
        every core loses a core to each running copy thread, and its other threads then wait
        at the region's barrier for the one that was preempted, so every millisecond of
        copying (and hashing) costs the step up to a millisecond on each core. With the
        copies on cores of their own, a PagedAdamW step that streams half its state took
        0.80-0.87 x the time on the 2-core build machine, and the checksums' share of it fell
        from 2.9-3.7 x the least hashing costs to 0.4-1.4 x (``benchmarks/results/
        checksums.md``, ``checksums_rerun.md``; ``docs/paging.md`` has the rest).
        """
        threads = torch.get_num_threads()
        fewer = max(1, threads - copy_threads)
        if fewer == threads or self._pool.idle():
            yield
            return
        torch.set_num_threads(fewer)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


class CudaCopyEngine(CopyEngine):
    """CUDA version: host↔device copies on a side stream ordered by events.

    Pinned host homes copy directly on the side stream. Spill-map homes are staged through a
    pinned buffer per slot by the worker thread (a page fault must not block a stream); the
    staged H2D is queued by the first engine call after the read lands (the sweep makes one
    per page), so it overlaps the compute before :meth:`wait`, which only queues it when the
    read was late. The worker, never the stepping thread, waits for a staged write-back's
    device-to-host copy (its event) before writing the spill file, so the step's host syncs do
    not grow with the pages on disk (the stepping thread waits only for the worker).

    Args:
        device: The CUDA device.
        host: The accountant the staging buffers are pinned with (``None``: the one in effect,
            :func:`tightfit.tiers.pinned.current`); they are unlocked when slots are freed and
            on :meth:`close`.
        stream_name: The role of the side stream (``"pages"``, ``"activations"``): engines of
            one role on one device share a dedicated stream (:func:`copy_stream`).

    :meth:`wait` returns the seconds the host was blocked plus the seconds the compute stream
    stood waiting for copies on the GPU (timed with events, read without a sync once both have
    completed: a wait's GPU stall is counted by a later call).
    """

    _help_queue = False  # the queue's tasks wait for device events: the worker's alone

    def __init__(self, device: torch.device, host: PinnedHost | None = None,
                 stream_name: str = "activations") -> None:
        super().__init__()
        self.device = device
        self.stream = copy_stream(device, stream_name)
        self.host = host if host is not None else pinned.current()
        self._staging: dict[int, PinnedBuffer] = {}
        self._spare: list[PinnedBuffer] = []  # staging buffers of freed slots, for the next
        self._timed: deque[tuple[object, object]] = deque()  # (compute arrived, copy done)
        self._staged: deque[StagedLoad] = deque()  # staged loads whose H2D is not queued yet
        self._queued = False  # stream work queued since the last synchronize()

    def _stage(self, slot: torch.Tensor) -> torch.Tensor:
        key = slot.data_ptr()
        buf = self._staging.get(key)
        if buf is None or buf.nbytes < slot.numel():
            if buf is not None:
                self._spare.append(buf)
            fits = [b for b in self._spare if b.nbytes >= slot.numel()]
            if fits:  # a re-plan's new slot reuses one (page-locking costs milliseconds)
                buf = min(fits, key=lambda b: b.nbytes)
                self._spare.remove(buf)
            else:
                buf = self.host.pin(slot.numel(), "staging buffers", self.device)
            self._staging[key] = buf
        return buf.tensor[: slot.numel()]

    def load(self, home: torch.Tensor | Home, slot: torch.Tensor) -> object:
        self._issue_read()
        self._queued = True
        if _pinned(home):
            self._wait_for_compute()
            with torch.cuda.stream(self.stream):
                slot.copy_(home, non_blocking=True)
                event = timing_event()
                event.record(self.stream)
            return ("event", event)
        staging = self._stage(slot)
        ready = torch.cuda.Event()  # the compute queued so far (the slot's last use) comes first
        ready.record(torch.cuda.current_stream(self.device))
        staged = StagedLoad(self._pool.submit(read_home, home, staging), staging, slot, ready)
        self._staged.append(staged)
        return ("staged", staged)

    def _issue_read(self) -> None:
        """Queue the H2D of every staged load whose disk read has landed (called from each
        engine call on the caller's thread, where every stream operation is made): the copy
        then overlaps the compute before its :meth:`wait`."""
        while self._staged and self._staged[0].task.done:
            self._staged.popleft().issue(self.stream)
            self._queued = True

    def wait(self, handle: object) -> float:
        t0 = time.perf_counter()
        if handle[0] == "staged":  # type: ignore[index]
            staged = handle[1]  # type: ignore[index]
            staged.task.result()  # the read (raises a failed one)
            self._issue_read()
            staged.issue(self.stream)  # (when an earlier one is still being read)
            self._queued = True
            event = staged.done
        else:
            event = handle[1]  # type: ignore[index]
        compute = torch.cuda.current_stream(self.device)
        arrived = timing_event()
        arrived.record(compute)
        # The compute stream waits on the GPU; the host does not block.
        compute.wait_event(event)
        self._timed.append((arrived, event))
        return time.perf_counter() - t0 + self._gpu_stalls()

    def _gpu_stalls(self, all_done: bool = False) -> float:
        """Seconds the compute stream waited for copies, of the waits whose events have
        completed (``query``: no sync); ``all_done``: the device was synchronized."""
        stalled = 0.0
        while self._timed:
            arrived, done = self._timed[0]
            if not all_done and not (arrived.query() and done.query()):  # type: ignore[attr-defined]
                break
            self._timed.popleft()
            stalled += stall_seconds(arrived, done)
        return stalled

    def store(self, slot: torch.Tensor, home: torch.Tensor | Home) -> None:
        self._issue_read()
        self._queued = True
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(done)
        if _pinned(home):
            with torch.cuda.stream(self.stream):
                home.copy_(slot, non_blocking=True)
            return
        staging = self._stage(slot)
        with torch.cuda.stream(self.stream):
            staging.copy_(slot, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)

        def write() -> None:
            copied.synchronize()
            write_home(home, staging)

        self._pending.append(self._pool.submit(write))

    def offload(self, src: torch.Tensor, home: torch.Tensor) -> object:
        if not home.is_pinned():
            raise ValueError("CudaCopyEngine.offload moves device bytes to pinned host memory; "
                             "take the home from a pinned pool (tightfit.tiers.regions."
                             "pinned_pool)")
        return ("event", *self._after_compute(lambda: home.copy_(src, non_blocking=True)))

    def retire(self, handle: object) -> float:
        # The compute stream waits for the copy on the GPU: memory the source frees is only
        # reused by kernels queued after it. The host does not block.
        return self.wait(handle)

    def fetch(self, home: torch.Tensor, dst: torch.Tensor) -> object:
        return ("event", *self._after_compute(lambda: dst.copy_(home, non_blocking=True)))

    def forget(self, handle: object) -> None:
        # The tensor was allocated on the compute stream and the copy uses it on the side
        # stream: before its memory goes back to the caching allocator (which hands it out
        # again in the compute stream's order), the compute stream waits for the copy —
        # torch's deterministic alternative to record_stream, which would hold every such
        # block until the side stream's later copies (the next prefetch) are done too.
        _, done, compute = handle  # type: ignore[misc]
        compute.wait_event(done)  # the stream the tensor was allocated on

    def then(self, fn: Callable[[], object]) -> CopyTask:
        self._queued = True
        done = torch.cuda.Event()
        done.record(self.stream)
        return self._pool.submit(_wait_then, done, fn)

    def _wait_for_compute(self) -> None:
        """The side stream waits for the compute queued so far (``wait_stream``, as an event):
        before a load writes a slot, the compute's last use of that memory comes first — a
        fresh slot's memory may be what the compute just freed, and a slot's update is
        ordered by ``store()`` only when it did not fail (``finish_step`` after an error)."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)

    def _after_compute(self, copy: Callable[[], object]) -> tuple[object, object]:
        """Run ``copy`` on the side stream after the compute queued so far (it made the
        source, or last used the memory a fresh ``dst`` reuses); return the event after it
        and the compute stream (where the copy's device tensor was allocated)."""
        self._queued = True
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            copy()
            done = timing_event()
            done.record(self.stream)
        return done, compute

    def synchronize(self) -> None:
        # Nothing queued since the last one: nothing to wait for (state_dict() and save()
        # read page after page, and each read synchronizes: one sync, not three per page).
        # A device page the host reads is copied on the compute stream, in its order.
        if not self._queued and not self._pending:
            return
        self.stream.synchronize()
        super().drain()
        torch.cuda.current_stream(self.device).synchronize()
        self._queued = False

    def gpu_stall_seconds(self) -> float:
        """Seconds of GPU stall not yet returned by :meth:`wait` (read once the device is
        synchronized: every event has completed)."""
        return self._gpu_stalls(all_done=True)

    def _release_staging(self) -> None:
        buffers = [*self._staging.values(), *self._spare]
        self._staging, self._spare = {}, []
        for buf in buffers:  # PinnedHost.release synchronizes the device first
            buf.release()

    @contextlib.contextmanager
    def beside_copies(self, copy_threads: int) -> Iterator[None]:
        """The update runs on the GPU: the host's cores are left to the copies already."""
        yield

    def slots_freed(self) -> None:
        # staging buffers are keyed by slot address: the new plan's slots take these spares
        # (as many as the window has slots); the rest are unlocked
        spare = [*self._staging.values(), *self._spare]
        self._staging = {}
        spare.sort(key=lambda b: -b.nbytes)
        self._spare = spare[:_KEPT_STAGING]
        for buf in spare[_KEPT_STAGING:]:
            buf.release()

    def close(self) -> None:
        # a load still in flight on the side stream (a step that failed) must land before
        # its slot's memory can be reused
        try:
            self.stream.synchronize()
        finally:
            try:
                super().close()
            finally:
                self._timed.clear()
                self._staged.clear()
                self._release_staging()


_KEPT_STAGING = 2  # spare staging buffers kept across a re-plan: the streaming window's slots


def _wait_then(event: object, fn: Callable[[], object]) -> None:
    event.synchronize()  # type: ignore[attr-defined]
    fn()
