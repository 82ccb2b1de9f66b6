"""Ctrl-C held until the paging state is whole again.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is at when SIGINT
arrives. Inside an optimizer step some of those moments are between two things that must
happen together: the fused kernel returned (params and the page's state are updated) but the
page is not yet marked done, so ``finish_step()`` would update it twice; or it is marked but its
write-back is not yet queued, so the update would be lost. :class:`InterruptHold` keeps the
signal for later: it swaps in a handler that only records the signal, and hands it to the
previous handler at a *safe point* (:meth:`InterruptHold.deliver`, called by the sweep between
pages) or when the block ends. Ctrl-C therefore still stops a step within about one page's
update, and the state it leaves is always one ``finish_step()`` can complete.

Only the main thread receives signals, so elsewhere the hold does nothing; nor does it when
SIGINT is not handled in Python (ignored, or the default action of killing the process).
Holds nest: an inner one hands a signal to the outer one, which delivers it at its own safe
point.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any


class InterruptHold:
    """Context manager: SIGINT is recorded while inside, delivered at safe points and at exit."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._pending: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> InterruptHold:
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if callable(previous):  # not SIG_IGN / SIG_DFL / a handler set outside Python
            self._previous = previous
            signal.signal(signal.SIGINT, self._record)
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._pending = (signum, frame)

    def deliver(self) -> None:
        """A safe point: hand a signal that arrived since the last one to the previous handler
        (Python's default raises ``KeyboardInterrupt`` here); then keep holding."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._previous(*pending)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is None:
            return
        if signal.getsignal(signal.SIGINT) == self._record:
            signal.signal(signal.SIGINT, self._previous)
        # the user's Ctrl-C wins over an error already on its way out (which becomes its
        # __context__): they asked to stop, and the state is consistent either way
        self.deliver()


def hold_interrupts() -> InterruptHold:
    """A new :class:`InterruptHold` (``with hold_interrupts() as hold: ... hold.deliver()``)."""
    return InterruptHold()
