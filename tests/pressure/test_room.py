"""machine_room: the bytes a step could add, and the limit that binds them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tightfit.measure.cgroup import MemoryCgroup
from tightfit.pressure import room


def test_a_cgroup_tighter_than_the_ram_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cg = MemoryCgroup(Path("/nowhere"), 1, 1 << 30)
    monkeypatch.setattr(room, "mem_available", lambda: 20 << 30)
    monkeypatch.setattr(room, "limiting_cgroup", lambda: cg)
    monkeypatch.setattr(room, "cgroup_room", lambda c: (1 << 30) - (300 << 20) if c is cg else 0)
    got = room.machine_room(torch.device("cpu"))
    assert got.bytes == (1 << 30) - (300 << 20)
    assert got.limit == "the memory cgroup's limit (1.00 GiB) less the 300 MiB it charges now"


def test_the_cgroup_room_is_its_charge_less_page_cache(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memory.usage_in_bytes").write_text(str(700 << 20))
    (tmp_path / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {100 << 20}\n"
                                          f"total_active_file {50 << 20}\n")
    cg = MemoryCgroup(tmp_path, 1, 1 << 30)
    monkeypatch.setattr(room, "mem_available", lambda: 20 << 30)
    monkeypatch.setattr(room, "limiting_cgroup", lambda: cg)
    assert room.machine_room(torch.device("cpu")).bytes == (1 << 30) - (550 << 20)


def test_without_a_cgroup_the_ram_available_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "mem_available", lambda: 3 << 30)
    monkeypatch.setattr(room, "limiting_cgroup", lambda: None)
    got = room.machine_room(torch.device("cpu"))
    assert (got.bytes, got.limit) == (3 << 30, "the RAM available (MemAvailable)")
