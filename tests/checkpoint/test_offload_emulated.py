"""Offloaded activations through CUDA's copy engine (side stream, events, pinned host pool),
run on the CPU over fake streams and events: the accelerator path's logic, not CUDA itself
(``test_cuda.py`` runs that on a GPU).

Emulation only: copies run at once, an event must be recorded before anything waits on it,
"pinned" buffers are CPU tensors remembered as pinned, and the device is the CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tightfit.checkpoint as ck
from tightfit.checkpoint.plan import OffloadTier

from .conftest import tiny_llama
from .offloaded import MIN_BYTES, install, max_diff, offloader, step

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")


class _Event:
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited on an event that was never recorded"


class _Stream:
    waits = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        assert event.recorded, "a stream waited on an event that was never recorded"
        _Stream.waits += 1

    def synchronize(self) -> None:
        pass


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fake CUDA streams and events; returns the sizes of the pinned buffers made."""
    made: list[int] = []
    ptrs: set[int] = set()
    empty = torch.empty

    def fake_empty(*args, pin_memory: bool = False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = empty(*args, **kwargs)
        if pin_memory:
            ptrs.add(t.untyped_storage().data_ptr())
            made.append(t.nbytes)
        return t

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a: self.untyped_storage().data_ptr() in ptrs)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    return made


def test_pinned_host_tier_through_the_cuda_engine(pinned: list[int]) -> None:
    torch.manual_seed(0)
    model = tiny_llama(layers=4, hidden=64, dropout=0.2, vocab=256)
    x = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": x, "labels": x}
    loss0, g0, _ = step(model, batch)
    prof = ck.profile(model, batch)
    tier = OffloadTier("host", 1e9, True, MIN_BYTES)
    plan = install(model, prof, ["stored_offload", "checkpoint_offload"], tier=tier)
    try:
        off = offloader(model)
        assert type(off.engine).__name__ == "CudaCopyEngine" and off.pool.tier == "host"
        waits = _Stream.waits
        results = [step(model, batch) for _ in range(3)]
        assert _Stream.waits > waits  # the compute stream waited on the copies' events
        assert off.pool.chunks_made == 1 and len(pinned) == 1  # one pinned buffer, reused
        assert off.bytes_offloaded == 3 * plan.host_bytes
        assert off.pool.used_bytes == 0
    finally:
        ck.disable(model)
    for loss1, g1, peak in results:
        assert torch.equal(loss0, loss1) and max_diff(g0, g1) <= 1e-6
        assert 0.9 * plan.predicted_peak_bytes <= peak <= 1.1 * plan.predicted_peak_bytes
