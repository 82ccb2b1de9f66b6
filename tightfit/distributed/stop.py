"""One rank fails in its step: every rank learns of it and saves the last completed step once.

Under torchrun a rank that runs out of memory in forward/backward cannot retry alone, and its
peers are left waiting in FSDP2's (or DDP's) next collective of that step, which the failed
rank never joins: nothing on the training process group can reach them any more. So the
news travels outside it:

* the failed rank writes one line (its rank and what failed) under :data:`STOP_KEY` in
  torchrun's rendezvous store (the store torchrun's agent keeps; it does not depend on the
  training process group);
* every rank runs a watcher thread from the start, polling that key; a peer's watcher
  wakes while its main thread is stuck in the dead collective, waits until that thread is
  parked there (:func:`wait_parked`), and joins the save;
* the save is the usual collective one (DCP writes each rank's shards once, rank 0 the
  trainer state), run over a second gloo group made for it at the start (:attr:`PeerStop.group`),
  from the failed rank's main thread and every peer's watcher thread at once. The state is
  that of the last completed step: forward/backward changed no parameter and no optimizer
  state, and the step's update, which does, holds :attr:`PeerStop.lock`, which the save
  takes too.

The failed rank then raises with its line; torchrun stops the other processes.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["STOP_KEY", "PeerStop", "wait_parked"]

STOP_KEY = "tightfit/stop"
_DONE = "done"  # written at a normal close: the watchers have nothing to do
_POLL_S = 0.25  # how often the watcher looks at the store


class PeerStop:
    """This rank's part: the store key, the save group, the update lock, the watcher.

    Every rank must create it at the same point (the save group is made collectively).
    """

    def __init__(self, save_timeout_s: float = 300.0) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.store = c10d._get_default_store()  # noqa: SLF001 (torchrun's store)
        self.save_timeout_s = save_timeout_s
        # CPU objects only (DCP's plans, the adapter's shards): gloo under NCCL too; a
        # timeout so that a rank that cannot join fails the save instead of hanging it
        self.group = torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=save_timeout_s))
        self.lock = threading.RLock()  # held by the step's update and by the save
        self.peer_line: str | None = None  # the failed rank's line, once a peer read it
        self.saved = threading.Event()  # set once this rank's watcher ran the save
        self._failing = False
        self._closed = False
        self._on_stop: Callable[[str], None] | None = None
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._watch, name="tightfit-peer-stop",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def on_stop(self, save: Callable[[str], None]) -> None:
        """What a peer's watcher runs (with :attr:`lock` held) when another rank failed:
        the collective save of the last completed step; it gets the failed rank's line."""
        self._on_stop = save

    def fail(self, line: str) -> None:
        """Tell every rank this one failed (the first failure's line is kept); the caller
        then runs the same save as the peers."""
        self._failing = True
        # the first writer wins: a second rank failing at once keeps the first line
        self.store.compare_set(STOP_KEY, "", line)

    def close(self) -> None:
        """End of the job: wake the watchers with nothing to do (unless a rank failed)."""
        self._closed = True
        with contextlib.suppress(RuntimeError, ValueError):  # the store's host went away
            self.store.compare_set(STOP_KEY, "", _DONE)

    def _watch(self) -> None:
        # polled, not waited on: the store's client connection is shared with the main
        # thread (a blocking wait would hold it, and log a timeout at every renewal)
        while True:
            try:
                if self.store.check([STOP_KEY]):
                    break
            except RuntimeError:  # the store's host went away: the job is over
                return
            if self._closed:
                return
            time.sleep(_POLL_S)
        try:
            line = self.store.get(STOP_KEY).decode()
        except RuntimeError:
            return
        if line == _DONE or self._failing or self._on_stop is None:
            return
        self.peer_line = line
        wait_parked(self._main)
        try:
            with self.lock:
                self._on_stop(line)
        except Exception as exc:  # noqa: BLE001 (a thread has no caller to raise to)
            print(f"tightfit: rank {torch.distributed.get_rank()}: the save after the other "
                  f"rank's failure failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            self.saved.set()


def wait_parked(thread: threading.Thread, *, settle_s: float = 1.0,
                give_up_s: float = 60.0) -> bool:
    """Wait until ``thread`` is parked: its innermost Python frame has not moved for
    ``settle_s`` and lies in ``torch.distributed`` (a collective that will not return), or
    has not moved for 5 x ``settle_s`` anywhere (a blocking device sync). ``False`` after
    ``give_up_s`` without that.

    Why: the peer's main thread may still be computing the failed step's forward (FSDP2
    swapping a block's gathered parameters in, the optimizer's watch moving pages) for a
    moment before it reaches the collective it will never leave; the save reads both.
    """
    start = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - start < give_up_s:
        frame = sys._current_frames().get(thread.ident or -1)  # noqa: SLF001
        if frame is None:
            return True  # it ended
        where = (id(frame), frame.f_lasti, frame.f_code.co_filename)
        now = time.monotonic()
        in_collective = "torch/distributed" in where[2].replace("\\", "/")
        if where != last:
            last, since = where, now
        elif now - since >= (settle_s if in_collective else 5 * settle_s):
            return True
        time.sleep(0.05)
    return False
