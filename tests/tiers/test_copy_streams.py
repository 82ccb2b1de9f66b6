"""CUDA's copy engine, issue 25 finding 12: a staged (disk) load's H2D is queued as soon as its
read lands, not at ``wait()``; ``wait()`` counts the GPU time the compute stream stood waiting
(events), not only the host's; the side streams are dedicated ones, not torch's pool's.
Under the strict CUDA emulation (``tests/tiers/strict_cuda.py``, ``tests/conftest.py``)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from tightfit.tiers import streams
from tightfit.tiers.copy import CudaCopyEngine

from .strict_cuda import Event
from .strict_pinned import strict_pinned  # noqa: F401 (the fixture)


class _DiskHome:
    """A home that reads its bytes on the copy worker (as a spill-file page does)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def read_into(self, dst: torch.Tensor) -> None:
        dst.fill_(self.value)

    def write_from(self, src: torch.Tensor) -> None:
        raise AssertionError("not written here")


def test_a_staged_load_is_queued_once_its_read_lands_not_at_wait(strict_cuda, strict_pinned) -> None:  # noqa: F811, E501
    engine = CudaCopyEngine(torch.device("cpu"))
    slots = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]
    handle = engine.load(_DiskHome(7), slots[0])
    deadline = time.monotonic() + 10
    task = getattr(handle[1], "task", handle[1])  # the worker's read
    while not task.done and time.monotonic() < deadline:
        time.sleep(0.001)
    home = torch.empty(4096, dtype=torch.uint8, pin_memory=True).fill_(3)
    second = engine.load(home, slots[1])  # the next engine call: the H2D is queued now
    engine.stream.synchronize()  # what the side stream was given has run
    assert torch.equal(slots[0], torch.full_like(slots[0], 7))  # before wait()
    engine.wait(handle)
    engine.wait(second)
    engine.close()


class _TimedEvent(Event):
    """The emulation's event with a time: ``now[0]`` (ms) when it was recorded."""

    now = [0.0]

    def record(self, stream: object = None) -> None:
        super().record(stream)
        self.ms = self.now[0]

    def elapsed_time(self, other: _TimedEvent) -> float:
        return other.ms - self.ms


def test_wait_counts_the_time_the_gpu_stood_waiting(strict_cuda, strict_pinned, monkeypatch) -> None:  # noqa: F811, E501
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    engine = CudaCopyEngine(torch.device("cpu"))
    home = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    slot = torch.zeros(4096, dtype=torch.uint8)
    _TimedEvent.now[0] = 5000.0  # the copy completes at 5 s
    late = engine.load(home, slot)
    _TimedEvent.now[0] = 0.0  # the compute reaches the wait at 0 s: 5 s stalled on the GPU
    stalled = engine.wait(late)
    _TimedEvent.now[0] = 9000.0  # a copy done before the compute needs it: no stall
    early = engine.load(home, slot)
    _TimedEvent.now[0] = 10000.0
    stalled += engine.wait(early) + engine.gpu_stall_seconds()
    assert 5.0 <= stalled < 5.5  # the host blocked for far less (the emulation's copies)
    engine.close()


def test_copy_streams_are_dedicated_non_blocking_and_made_once(monkeypatch) -> None:
    made: list[tuple[int, int]] = []

    class _Runtime:
        def cudaStreamCreateWithFlags(self, out, flags: int) -> int:  # noqa: ANN001, N802
            out._obj.value = 0x1000 + len(made)
            made.append((out._obj.value, flags))
            return 0

    wrapped: list[tuple[int, torch.device]] = []

    def external(handle: int, device: torch.device) -> tuple[str, int]:
        wrapped.append((handle, device))
        return ("external", handle)

    monkeypatch.setattr(streams, "_cuda_runtime", lambda: _Runtime())
    monkeypatch.setattr(streams, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "ExternalStream", external)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("drew a pool stream"))
    dev = torch.device("cuda", 0)
    first = streams.copy_stream(dev, "pages")
    assert streams.copy_stream(dev, "pages") is first  # a re-plan's engine: the same stream
    other = streams.copy_stream(dev, "activations")
    assert other != first
    assert [f for _, f in made] == [1, 1]  # cudaStreamNonBlocking, one per role
    assert [d for _, d in wrapped] == [dev, dev]



def test_cuda_engine_leaves_torch_threads_as_they_are(strict_cuda, strict_pinned) -> None:  # noqa: F811
    # the update runs on the GPU there: the host's intra-op threads are not the update's
    engine = CudaCopyEngine(torch.device("cpu"))
    n = torch.get_num_threads()
    with engine.beside_copies(8):
        assert torch.get_num_threads() == n
    engine.close()
