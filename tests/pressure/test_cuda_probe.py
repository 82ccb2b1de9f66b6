"""Finding 10 (issue 25): CudaProbe on the CPU, over a fake torch.cuda allocator state.

The probe must cap its capacity by the per-process memory fraction, must not count the holes
of split segments as room, and its high-water gate must survive ``reset_peak_memory_stats``
(which MemoryTracker calls every ``track_every`` steps)."""

from __future__ import annotations

import pytest
import torch

from tightfit.pressure.probes import CudaProbe

MiB = 1 << 20


class FakeAllocator:
    """What torch.cuda reports: the driver's free/total and the caching allocator's stats."""

    def __init__(self, total: int = 1000 * MiB) -> None:
        self.total = total
        self.others = 0  # bytes other processes/contexts hold
        self.allocated = 0
        self.reserved = 0
        self.split_holes = 0
        self.peak = 0
        self.fraction = 1.0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated + self.split_holes)
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int, *, hole: bool = False) -> None:
        self.allocated -= n
        self.split_holes += n if hole else 0

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info",
                            lambda dev=None: (self.total - self.others - self.reserved, self.total))
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda dev=None: self.fraction)
        monkeypatch.setattr(cuda, "memory_stats", lambda dev=None: {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "inactive_split_bytes.all.current": self.split_holes,
        })


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    a = FakeAllocator()
    a.install(monkeypatch)
    return a


def test_capacity_is_capped_by_the_per_process_memory_fraction(gpu: FakeAllocator) -> None:
    gpu.fraction = 0.5
    probe = CudaProbe("cuda:0")
    assert probe.capacity_bytes() == 500 * MiB
    gpu.alloc(100 * MiB)
    # the room is what the fraction still lets this process reserve, not the device's free
    assert probe.capacity_bytes() - probe.used_bytes() == 400 * MiB
    gpu.others = 700 * MiB  # another process takes most of the device: the driver limits
    assert probe.capacity_bytes() - probe.used_bytes() == (1000 - 700 - 100) * MiB


def test_whole_free_segments_are_room_split_holes_are_not(gpu: FakeAllocator) -> None:
    probe = CudaProbe(0)
    gpu.alloc(300 * MiB)
    assert probe.used_bytes() == 300 * MiB
    gpu.free(100 * MiB)  # a whole segment back in the cache: torch reuses it for any size
    assert probe.used_bytes() == 200 * MiB
    gpu.free(80 * MiB, hole=True)  # evicted pages' holes inside split segments
    assert probe.used_bytes() == 200 * MiB  # not room for a large activation
    assert probe.capacity_bytes() == 1000 * MiB


def test_without_the_split_statistic_no_cached_byte_is_room(gpu: FakeAllocator,
                                                            monkeypatch) -> None:
    probe = CudaProbe(0)
    gpu.alloc(300 * MiB)
    gpu.free(100 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev=None: {
        "allocated_bytes.all.current": gpu.allocated, "reserved_bytes.all.current": gpu.reserved})
    assert probe.used_bytes() == 300 * MiB


def test_the_high_water_gate_survives_peak_resets(gpu: FakeAllocator) -> None:
    gpu.alloc(600 * MiB)  # the planner's timing passes, before the probe is built
    gpu.free(600 * MiB)
    probe = CudaProbe(0)
    assert probe.interval_peak_bytes() is None
    gpu.reset_peak()  # MemoryTracker, every track_every steps
    gpu.alloc(200 * MiB)
    gpu.free(150 * MiB)  # a transient between two readings, below the old 600 MiB peak
    assert probe.used_bytes() == 50 * MiB
    assert probe.interval_peak_bytes() == 200 * MiB  # was None: gated by the stale 600 MiB
    assert probe.interval_peak_bytes() is None  # nothing new since
    gpu.alloc(250 * MiB)
    gpu.free(250 * MiB)
    assert probe.interval_peak_bytes() == 300 * MiB


def test_the_runs_cuda_peak_survives_the_trackers_resets(gpu: FakeAllocator, monkeypatch) -> None:
    from tightfit.train.memory import StepMemory

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: gpu.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: gpu.peak)
    mem = StepMemory(torch.device("cuda", 0))
    gpu.alloc(400 * MiB)
    gpu.free(400 * MiB)
    assert mem.end_step()["mem_peak"] == 400 * MiB
    gpu.reset_peak()  # MemoryTracker, in the next step
    gpu.alloc(100 * MiB)
    assert mem.end_step()["mem_peak"] == 400 * MiB  # "so far", not since the last reset


def test_machine_room_on_cuda_is_the_probes_room_and_names_the_fraction(gpu) -> None:
    from tightfit.pressure.room import machine_room

    gpu.alloc(300 * MiB)
    gpu.free(100 * MiB, hole=True)  # 100 MiB of holes in split segments: not room
    room = machine_room(torch.device("cuda", 0))
    assert (room.bytes, room.limit) == (800 * MiB - 100 * MiB, "the CUDA device's free memory")
    gpu.fraction = 0.5
    room = machine_room(torch.device("cuda", 0))
    assert room.bytes == 500 * MiB - 300 * MiB
    assert room.limit == "this process's CUDA memory fraction (0.5 of the device)"
