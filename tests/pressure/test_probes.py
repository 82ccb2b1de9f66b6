"""Probes read real usage (RSS, CUDA) or a test's fake device, and remember their peak."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tightfit.pressure.probes import CudaProbe, RSSProbe, cgroup_memory_limit

from .fakes import FakeProbe

MiB = 2**20


def test_fake_probe_sums_sources_and_tracks_peak() -> None:
    level = {"act": 0}
    probe = FakeProbe(100 * MiB, [lambda: level["act"]], base_bytes=10 * MiB, record=True)
    assert probe.used_bytes() == 10 * MiB
    level["act"] = 30 * MiB
    probe.add_source(lambda: 5 * MiB)
    assert probe.used_bytes() == 45 * MiB
    level["act"] = 0
    assert probe.used_bytes() == 15 * MiB
    assert probe.peak_bytes == 45 * MiB
    assert probe.history == [10 * MiB, 45 * MiB, 15 * MiB]
    assert probe.reads == 3
    assert probe.headroom_bytes(50 * MiB) == 35 * MiB
    probe.reset_peak()
    assert probe.peak_bytes == 0 and probe.reads == 0
    assert probe.capacity_bytes() == 100 * MiB


def test_fake_probe_strict_raises_out_of_memory_above_capacity() -> None:
    level = {"act": 0}
    probe = FakeProbe(100, [lambda: level["act"]], strict=True)
    assert probe.used_bytes() == 0
    level["act"] = 101
    with pytest.raises(torch.OutOfMemoryError, match="exceed the fake capacity"):
        probe.used_bytes()
    assert probe.peak_bytes == 101  # the failing reading is still recorded


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [({"capacity_bytes": 0}, ValueError), ({"capacity_bytes": 10, "base_bytes": -1}, ValueError)],
)
def test_fake_probe_rejects_bad_input(kwargs: dict, err: type) -> None:
    with pytest.raises(err):
        FakeProbe(**kwargs)
    with pytest.raises(TypeError, match="callables"):
        FakeProbe(10).add_source(3)  # type: ignore[arg-type]


def test_rss_probe_sees_a_touched_allocation_come_and_go() -> None:
    probe = RSSProbe(capacity_bytes=64 * 2**30)
    before = probe.used_bytes()
    big = torch.ones(96 * MiB // 4)  # touched, so resident
    during = probe.used_bytes()
    del big
    after = probe.used_bytes()
    assert during - before >= 90 * MiB
    # large blocks are mmap'd by the allocator and returned to the OS when freed
    assert during - after >= 90 * MiB
    assert probe.peak_bytes == during
    # the kernel's high-water mark folds per-CPU RSS counters lazily: allow a few pages
    assert RSSProbe.process_peak_bytes() >= during - 4 * MiB
    assert probe.capacity_bytes() == 64 * 2**30


_TRANSIENT = """
import torch
from tightfit.pressure.probes import RSSProbe
MiB = 2**20
probe = RSSProbe(capacity_bytes=64 * 2**30)
probe.interval_peak_bytes()  # forget what importing did
before = probe.used_bytes()
transient = torch.ones(128 * MiB // 4)  # a new lifetime high, gone before the next reading
del transient
after = probe.used_bytes()
peak = probe.interval_peak_bytes()
print(before, after, peak, probe.interval_peak_bytes())
"""


def test_rss_probe_interval_peak_sees_a_transient_between_readings() -> None:
    # In a fresh process: the high-water mark only rises at a new lifetime high, and in this
    # one earlier tests may have left it far above 128 MiB over today's RSS (it then sees
    # nothing, correctly: what it reports is the kernel's mark, not a per-interval one)
    run = subprocess.run([sys.executable, "-c", _TRANSIENT], capture_output=True, text=True,
                         timeout=300, check=True)
    before, after, peak, again = run.stdout.split()
    assert peak != "None" and int(peak) - max(int(before), int(after)) >= 100 * MiB
    assert again == "None"  # nothing higher since


def test_rss_probe_capacity_defaults_to_cgroup_limit() -> None:
    limit = cgroup_memory_limit()
    assert limit is None or limit > 0
    assert RSSProbe().capacity_bytes() == limit
    with pytest.raises(ValueError, match="positive"):
        RSSProbe(capacity_bytes=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_probe_explains_missing_cuda() -> None:
    with pytest.raises(ValueError, match="RSSProbe"):
        CudaProbe()


@pytest.mark.cuda
def test_cuda_probe_counts_live_tensors_not_the_allocator_cache() -> None:
    probe = CudaProbe()
    torch.cuda.synchronize()
    before = probe.used_bytes()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    during = probe.used_bytes()
    del x  # the block stays reserved in torch's cache, but is headroom for us
    after = probe.used_bytes()
    assert during - before >= 256 * MiB
    assert during - after >= 256 * MiB
    assert probe.capacity_bytes() == torch.cuda.mem_get_info()[1]
    assert probe.allocator_peak_bytes() >= during - 1 * MiB
