"""The copy worker's queue: copies run one at a time, in order, by a worker thread or by the
thread that waits for one (:class:`CopyQueue`); the engines of :mod:`tightfit.tiers.copy` run
their page and activation copies through it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class CopyTask:
    """One queued copy; :meth:`result` waits for it (helping the queue if the worker is late)."""

    def __init__(self, queue: CopyQueue, fn: Callable[[], object]) -> None:
        self._queue, self._fn = queue, fn
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # re-raised in the thread that waits for it
            self.error = exc

    def result(self) -> None:
        self._queue.wait(self)
        if self.error is not None:
            raise self.error


class CopyQueue:
    """A FIFO of copies run one at a time by a worker thread, or by the waiting thread.

    Tasks run strictly in order and never two at once (a slot's write-back always lands
    before the slot is refilled). With ``help_waiters`` (the CPU engine), a thread that waits
    for a task the worker has not started runs the queue up to it itself: on a busy machine
    the worker may not be scheduled for milliseconds, and waiting for it to wake is pure loss;
    when it is running, the copies overlap with the update. Without it (CUDA's engine, whose
    write-backs wait for device events) only the worker runs tasks, until it has stopped.
    """

    def __init__(self, help_waiters: bool = True) -> None:
        self._tasks: deque[CopyTask] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._help = help_waiters
        self._working = False  # a worker thread is running (set and cleared under the lock)
        self._thread: threading.Thread | None = None  # started on the first copy

    def idle(self) -> bool:
        """Whether no task is queued or running."""
        with self._cond:
            return not self._busy and not self._tasks

    def submit(self, fn: Callable[..., object], *args: object) -> CopyTask:
        """Queue ``fn(*args)``."""
        task = CopyTask(self, lambda: fn(*args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="tightfit-pager", daemon=True)
            self._working = True
            self._thread.start()
        with self._cond:
            self._tasks.append(task)
            self._cond.notify_all()
        return task

    def _take(self) -> CopyTask | None:
        # caller holds the lock
        if self._busy or not self._tasks:
            return None
        self._busy = True
        return self._tasks.popleft()

    def _finish(self, task: CopyTask) -> None:
        with self._cond:
            task.done = True
            self._busy = False
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._take()
                while task is None:
                    if self._closed and not self._tasks:
                        self._working = False
                        self._cond.notify_all()  # a waiter without help runs what comes later
                        return
                    self._cond.wait()
                    task = self._take()
            task.run()
            self._finish(task)

    def wait(self, task: CopyTask) -> None:
        """Return once ``task`` has run (run here if waiters help, or the worker stopped)."""
        while True:
            with self._cond:
                if task.done:
                    return
                mine = self._take() if self._help or not self._working else None
                if mine is None:
                    self._cond.wait()
                    continue
            try:
                mine.run()
            finally:  # an interrupt here must not leave the queue busy for ever
                self._finish(mine)

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
