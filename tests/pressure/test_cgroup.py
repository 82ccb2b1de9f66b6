"""The memory cgroup: which one limits the process, and the probe of what it charges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tightfit.measure.cgroup import (
    MemoryCgroup,
    cgroup_room,
    limiting_cgroup,
    memory_cgroups,
    stat_value,
)
from tightfit.pressure import occupancy, probes
from tightfit.pressure.probes import CgroupProbe, RSSProbe

MiB = 2**20
V1_STAT = ("cache 5\nrss 7\ninactive_file 1\nactive_file 2\ntotal_cache {cache}\n"
           "total_rss 9\ntotal_inactive_file {inactive}\ntotal_active_file {active}\n")


def _tree(tmp_path: Path, listing: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake ``/proc/self/cgroup`` and cgroup mount with ``files`` (path -> text) in it."""
    root = tmp_path / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "cgroup"
    proc.write_text(listing)
    return proc, root


def test_the_smallest_limit_up_the_v1_path_wins_and_huge_means_none(tmp_path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/job/step\n3:cpu:/\n", {
        "memory/memory.limit_in_bytes": str(2**63 - 4096),  # v1's "no limit"
        "memory/job/memory.limit_in_bytes": str(900 * MiB),
        "memory/job/step/memory.limit_in_bytes": str(2000 * MiB),
    })
    found = memory_cgroups(proc, root)
    assert [c.path for c in found] == [root / "memory/job/step", root / "memory/job",
                                       root / "memory"]
    assert [c.limit for c in found] == [2000 * MiB, 900 * MiB, None]
    cg = limiting_cgroup(proc, root)
    assert cg == MemoryCgroup(root / "memory/job", 1, 900 * MiB)
    assert cg.charge_file.name == "memory.usage_in_bytes"
    assert cg.file_keys == (b"total_inactive_file", b"total_active_file")


def test_v2_reads_memory_max_and_no_limit_is_none(tmp_path) -> None:
    proc, root = _tree(tmp_path, "0::/user/app\n", {
        "cgroup.controllers": "cpu memory\n", "memory.max": "max\n",
        "user/app/memory.max": "max\n",
    })
    assert [c.limit for c in memory_cgroups(proc, root)] == [None, None]
    assert limiting_cgroup(proc, root) is None
    (root / "user/memory.max").write_text(f"{700 * MiB}\n")
    cg = limiting_cgroup(proc, root)
    assert cg == MemoryCgroup(root / "user", 2, 700 * MiB)
    assert cg.charge_file.name == "memory.current" and cg.file_keys == (b"inactive_file",
                                                                         b"active_file")
    assert limiting_cgroup(tmp_path / "missing", root) is None


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_probe_reads_the_charge_less_the_page_cache_each_time(tmp_path,
                                                                     version: int) -> None:
    cg = MemoryCgroup(tmp_path, version, 1000 * MiB)

    def write(charge: int, inactive: int, active: int) -> None:
        cg.charge_file.write_text(f"{charge}\n")
        stat = (V1_STAT if version == 1 else
                "anon 9\nfile {cache}\ninactive_anon 3\ninactive_file {inactive}\n"
                "active_file {active}\nunevictable 0\n")
        cg.stat_file.write_text(stat.format(cache=inactive + active, inactive=inactive,
                                            active=active))

    write(800 * MiB, 100 * MiB, 50 * MiB)
    probe = CgroupProbe(cg)
    assert probe.capacity_bytes() == 1000 * MiB
    assert probe.used_bytes() == 650 * MiB  # not the 800 MiB charge: the cache is reclaimed
    write(820 * MiB, 10 * MiB, 10 * MiB)  # a spike's anonymous memory pushes the cache out
    assert probe.used_bytes() == 800 * MiB
    assert probe.peak_bytes == 800 * MiB and probe.reads == 2
    probe.close()


def test_cgroup_probe_needs_a_limit_or_a_capacity(tmp_path) -> None:
    with pytest.raises(ValueError, match="no limit"):
        CgroupProbe(MemoryCgroup(tmp_path, 1, None))


def _own_cgroup() -> MemoryCgroup | None:
    """This process's own memory cgroup when its files can be read (no limit needed)."""
    for cg in memory_cgroups():
        if cg.charge_file.exists() and cg.stat_file.exists():
            return cg
    return None


@pytest.mark.skipif(_own_cgroup() is None, reason="no readable memory cgroup")
def test_cgroup_probe_sees_a_touched_allocation_come_and_go() -> None:
    probe = CgroupProbe(_own_cgroup(), capacity_bytes=64 << 30)
    before = probe.used_bytes()
    big = torch.ones(96 * MiB // 4)  # touched: anonymous memory the cgroup charges
    during = probe.used_bytes()
    del big
    after = probe.used_bytes()
    # other processes of the cgroup may allocate meanwhile: allow them a little
    assert during - before >= 80 * MiB and during - after >= 80 * MiB
    assert probe.peak_bytes == during


_TRANSIENT = """
import torch
from tightfit.measure.cgroup import memory_cgroups
from tightfit.pressure.probes import CgroupProbe
MiB = 2**20
cg = next(c for c in memory_cgroups() if c.charge_file.exists() and c.stat_file.exists())
probe = CgroupProbe(cg, capacity_bytes=64 << 30)
probe.interval_peak_bytes()  # forget what importing did
probe.used_bytes()
transient = torch.ones(256 * MiB // 4)  # a new lifetime high (importing peaks ~130 MiB over
# today's RSS), gone before the next reading
del transient
after = probe.used_bytes()
print(after, probe.interval_peak_bytes(), probe.interval_peak_bytes())
"""


@pytest.mark.skipif(_own_cgroup() is None, reason="no readable memory cgroup")
def test_cgroup_probe_interval_peak_sees_a_transient_between_readings() -> None:
    # a fresh process, so the RSS high-water mark the transient must raise is today's
    run = subprocess.run([sys.executable, "-c", _TRANSIENT], capture_output=True, text=True,
                         timeout=300, check=True)
    after, peak, again = run.stdout.split()
    assert peak != "None" and int(peak) - int(after) >= 200 * MiB
    assert again == "None"  # nothing higher since


def test_the_cpu_default_probe_reads_the_cgroup_that_limits_it(tmp_path, monkeypatch) -> None:
    cg = MemoryCgroup(tmp_path, 1, 900 * MiB)
    cg.charge_file.write_text(f"{500 * MiB}\n")
    cg.stat_file.write_text(V1_STAT.format(cache=100 * MiB, inactive=60 * MiB,
                                           active=40 * MiB))
    monkeypatch.setattr(occupancy, "limiting_cgroup", lambda: cg)
    monkeypatch.setattr(probes, "cgroup_memory_limit", lambda: cg.limit)
    probe = occupancy.default_probe(torch.device("cpu"))
    assert isinstance(probe, CgroupProbe) and probe.capacity_bytes() == 900 * MiB
    assert probe.used_bytes() == 400 * MiB
    probe.close()
    # a limit without a cgroup to read (a test standing one in): RSS against that limit
    monkeypatch.setattr(probes, "cgroup_memory_limit", lambda: 64 << 30)
    monkeypatch.setattr(occupancy, "limiting_cgroup", lambda: None)
    probe = occupancy.default_probe(torch.device("cpu"))
    assert type(probe) is RSSProbe and probe.capacity_bytes() == 64 << 30
    monkeypatch.setattr(probes, "cgroup_memory_limit", lambda: None)  # no limit at all
    assert type(occupancy.default_probe(torch.device("cpu"))) is RSSProbe


def test_stat_value_finds_first_middle_and_missing_keys() -> None:
    stat = b"anon 5\nfile 7\ninactive_file 3"
    assert [stat_value(stat, k) for k in (b"anon", b"file", b"inactive_file", b"active_file")] \
        == [5, 7, 3, 0]


def test_cgroup_room_is_the_limit_less_what_the_kernel_cannot_reclaim(tmp_path) -> None:
    proc, root = _tree(tmp_path, "4:memory:/job\n", {
        "memory/job/memory.limit_in_bytes": str(900 * MiB),
        "memory/job/memory.usage_in_bytes": str(700 * MiB),
        "memory/job/memory.stat": V1_STAT.format(cache=0, inactive=100 * MiB, active=50 * MiB),
    })
    cg = limiting_cgroup(proc, root)
    assert cgroup_room(cg) == 900 * MiB - (700 * MiB - 150 * MiB)  # page cache is room
    (root / "memory/job/memory.usage_in_bytes").write_text(str(1000 * MiB))
    (root / "memory/job/memory.stat").write_text(V1_STAT.format(cache=0, inactive=0, active=0))
    assert cgroup_room(cg) == 0  # over the limit: no room, never negative
    assert cgroup_room(MemoryCgroup(root / "memory/none", 1, None)) is None
