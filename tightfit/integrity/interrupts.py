"""Ctrl-C and SIGTERM held until the paging state is whole again.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is at when SIGINT
arrives. Inside an optimizer step some of those moments are between two things that must
happen together: the fused kernel returned (params and the page's state are updated) but the
page is not yet marked done, so ``finish_step()`` would update it twice; or it is marked but its
write-back is not yet queued, so the update would be lost. :class:`InterruptHold` keeps the
signal for later: it swaps in a handler that only records the signal, and hands it to the
previous handler at a *safe point* (:meth:`InterruptHold.deliver`, called by the sweep between
pages) or when the block ends. Ctrl-C therefore still stops a step within about one page's
update, and the state it leaves is always one ``finish_step()`` can complete.

SIGTERM (what ``docker stop``, SLURM and ``timeout`` send) kills the process outright by
default, with no ``finally`` run: nothing saved, temporary folders left behind.
:func:`terminate_as_interrupt` (the ``tightfit`` command line's) makes it raise
:class:`Terminated`, a ``KeyboardInterrupt``, so it takes Ctrl-C's path: held here like
SIGINT, the last completed step saved, temporary folders removed, exit code 143 (128 + 15).

Only the main thread receives signals, so elsewhere the hold does nothing; nor does it for a
signal not handled in Python (ignored, or the default action of killing the process).
Holds nest: an inner one hands a signal to the outer one, which delivers it at its own safe
point.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)  # what a hold keeps for its safe point


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt (:func:`terminate_as_interrupt`); ``signum`` says which."""

    signum = signal.SIGTERM


def interrupt_signal(exc: BaseException) -> int:
    """The signal an interrupt came from: its ``signum`` (SIGTERM for :class:`Terminated`),
    else SIGINT (Ctrl-C's ``KeyboardInterrupt``)."""
    return int(getattr(exc, "signum", signal.SIGINT))


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"terminated ({signal.Signals(signum).name})")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` (in the main thread; the handler before comes
    back after). Elsewhere than the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class InterruptHold:
    """Context manager: SIGINT (and SIGTERM when Python handles it) is recorded while inside,
    delivered at safe points and at exit."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._pending: list[tuple[int, FrameType | None]] = []

    def __enter__(self) -> InterruptHold:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in HELD:
            previous = signal.getsignal(signum)
            if callable(previous):  # not SIG_IGN / SIG_DFL / a handler set outside Python
                self._previous[signum] = previous
                signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append((signum, frame))

    def deliver(self) -> None:
        """A safe point: hand the signals that arrived since the last one to the previous
        handlers (Python's default for SIGINT raises ``KeyboardInterrupt`` here), in the order
        they came; then keep holding."""
        pending, self._pending = self._pending, []
        for signum, frame in pending:
            self._previous[signum](signum, frame)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._previous:
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._record:
                signal.signal(signum, previous)
        # the user's Ctrl-C wins over an error already on its way out (which becomes its
        # __context__): they asked to stop, and the state is consistent either way
        self.deliver()


def hold_interrupts() -> InterruptHold:
    """A new :class:`InterruptHold` (``with hold_interrupts() as hold: ... hold.deliver()``)."""
    return InterruptHold()
