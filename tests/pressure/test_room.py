"""machine_room: the bytes a step could add, and the limit that binds them."""

from __future__ import annotations

import pytest
import torch

from tightfit.pressure import room


def test_a_cgroup_tighter_than_the_ram_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "mem_available", lambda: 20 << 30)
    monkeypatch.setattr(room, "cgroup_memory_limit", lambda: 1 << 30)
    monkeypatch.setattr(room.RSSProbe, "used_bytes", lambda self: 300 << 20)
    got = room.machine_room(torch.device("cpu"))
    assert got.bytes == (1 << 30) - (300 << 20)
    assert got.limit == "the memory cgroup's limit (1.00 GiB) less the 300 MiB this process uses"


def test_without_a_cgroup_the_ram_available_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "mem_available", lambda: 3 << 30)
    monkeypatch.setattr(room, "cgroup_memory_limit", lambda: None)
    got = room.machine_room(torch.device("cpu"))
    assert (got.bytes, got.limit) == (3 << 30, "the RAM available (MemAvailable)")
