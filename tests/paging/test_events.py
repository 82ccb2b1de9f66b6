"""EventLog keeps the latest events but counts every one."""

from __future__ import annotations

from tightfit.paging.events import EventLog


def test_counts_survive_the_bound() -> None:
    log = EventLog(limit=3)
    for i in range(5):
        log.record("evict", f"r{i}", 10, 1, "device", "disk")
    log.record("restore", "back", 10, 1, "disk", "device")
    assert [e.reason for e in log.events] == ["r3", "r4", "back"]
    assert log.counts["evict"] == 5 and log.counts["restore"] == 1
    assert log.dropped == 3
