"""The planner's host side: the measured RAM within the memory cgroup's limit, and the bytes
pinned counted as tightfit pins them (to the page, not to a power of two)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tightfit.measure.cgroup import MemoryCgroup
from tightfit.planner import host
from tightfit.planner.host import host_limit, pinned_host_bytes, torch_pinned_host_bytes

GiB = 1 << 30


def test_measured_ram_is_capped_by_the_cgroup_limit(monkeypatch) -> None:
    ram = host.machine_ram_bytes()
    monkeypatch.setattr(host, "limiting_cgroup", lambda: MemoryCgroup(Path("/x"), 2, 3 * GiB))
    limit = host_limit(None)
    assert limit.measured and limit.ram_bytes == min(ram, 3 * GiB)
    assert "cgroup" in limit.describe()
    monkeypatch.setattr(host, "limiting_cgroup", lambda: None)
    assert host_limit(None).ram_bytes == ram
    assert host_limit("64GiB").ram_bytes == 64 * GiB  # given: not capped


def test_pinned_bytes_are_the_bytes_asked_to_the_page() -> None:
    chunk = 17 * GiB  # an offload pool's one chunk
    assert pinned_host_bytes([chunk]) == chunk
    assert torch_pinned_host_bytes([chunk]) == 32 * GiB
    pages = [8 << 20] * 19 + [3 << 20]  # optimizer host pages
    assert pinned_host_bytes(pages) == sum(pages)
    assert torch_pinned_host_bytes(pages) == 19 * (8 << 20) + (4 << 20)
    assert pinned_host_bytes([1]) == pinned_host_bytes([4096]) == 4096
    with pytest.raises(ValueError, match="pinned_fraction"):
        host_limit("64GiB", 0.0)
