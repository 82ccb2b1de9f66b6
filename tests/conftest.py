"""Shared test configuration: CUDA-only tests skip themselves without a GPU; seeding; threads;
CUDA's streams, events and pinned memory faked on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch intra-op thread for the test (opt in: ``pytestmark =
    pytest.mark.usefixtures("one_thread")``).

    On a shared, loaded 2-core machine intra-op threads over tiny tensors mostly wait for each
    other (a fused AdamW step on 30k elements took 23 ms with 2 threads, 1 ms with one);
    numerics do not change.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class _FakeEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited on an event that was never recorded"


@dataclass
class FakeCuda:
    """What :func:`fake_cuda` saw: sizes of the "pinned" buffers made, stream waits on events."""

    pinned_sizes: list[int] = field(default_factory=list)
    waits: int = 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """CUDA's streams, events and pinned host memory as the CPU can run them (the device
    stays the CPU): code written for ``CudaCopyEngine`` runs its schedule here, and an event
    waited on before it was recorded fails the test."""
    seen = FakeCuda()
    ptrs: set[int] = set()
    empty = torch.empty

    class _FakeStream:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def wait_event(self, event: _FakeEvent) -> None:
            assert event.recorded, "a stream waited on an event that was never recorded"
            seen.waits += 1

        def synchronize(self) -> None:
            pass

    def fake_empty(*args, pin_memory: bool = False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = empty(*args, **kwargs)
        if pin_memory:
            ptrs.add(t.untyped_storage().data_ptr())
            seen.pinned_sizes.append(t.nbytes)
        return t

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr() in ptrs)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    return seen
