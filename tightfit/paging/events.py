"""A record of what the pager did and why: one event per decision that moved bytes, and the
traffic counters.

The step sweep does not log here (its traffic is summed in :class:`PagingCounters`); explicit
residency changes do — evictions under pressure, restores, budget changes — so a report can say when
pages left the device, how many bytes, and what forced it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PagingEvent:
    """One residency change.

    Attributes:
        time: ``time.monotonic()`` when it happened.
        kind: ``"evict"``, ``"restore"``, ``"budget"`` or another short verb.
        reason: why, in words (``"pressure: 91% of device in use"``).
        nbytes: bytes of state moved.
        pages: number of pages moved.
        src: tier the pages left (``"device"``, ``"host"``, ``"disk"``).
        dst: tier they went to.
    """

    time: float
    kind: str
    reason: str
    nbytes: int
    pages: int
    src: str
    dst: str


@dataclass
class PagingCounters:
    """Cumulative traffic of a store (bytes are bytes of optimizer state)."""

    bytes_paged_in: int = 0  # into the device tier
    bytes_paged_out: int = 0  # out of the device tier
    page_faults: int = 0  # pages needed by an update that were not resident
    stall_seconds: float = 0.0  # time the update waited for copies


@dataclass
class EventLog:
    """The latest ``limit`` :class:`PagingEvent` s (a long run cannot grow it forever), plus a
    count of every event ever recorded, per kind, which the bound does not cut."""

    limit: int = 10_000
    events: deque[PagingEvent] = field(init=False)
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.limit)  # drops the oldest in O(1)

    @property
    def dropped(self) -> int:
        """Events no longer held (older than the latest ``limit``)."""
        return self.counts.total() - len(self.events)

    def record(self, kind: str, reason: str, nbytes: int, pages: int, src: str, dst: str) -> None:
        """Append one event (dropping the oldest past ``limit``)."""
        self.events.append(PagingEvent(time.monotonic(), kind, reason, nbytes, pages, src, dst))
        self.counts[kind] += 1
