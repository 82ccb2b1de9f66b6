"""On CUDA the profiler times the GPU's work with events, read after each step with one sync.

A host clock around asynchronous launches measures the launches: a matmul is queued in
microseconds and runs for milliseconds, so selective recompute (which keeps the matmuls) would
look several times dearer than it is. The emulation below is a GPU that runs every op later,
on a virtual clock the host never sees: matmuls are slow there and cheap to launch, a large
elementwise op is slow on the host (the CPU computes it) and nearly free there. Events record
the virtual clock; reading a pair before the host has waited for it fails, as CUDA's
``cudaErrorNotReady`` does.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tightfit.checkpoint as ck
from tightfit.checkpoint.selective import SAVED_OPS

# the package's profile() function shadows the module's name
profile_mod = importlib.import_module("tightfit.checkpoint.profile")

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")

MATMUL_MS = 1.0  # the emulated GPU's time for each kept op (a matmul)
OTHER_MS = 0.001  # and for any other op


class _VirtualGpu(TorchDispatchMode):
    """Every op queues work on one stream's virtual clock; the host waits only when told."""

    def __init__(self) -> None:
        super().__init__()
        self.queued_ms = 0.0  # the stream's clock once everything queued has run
        self.done_ms = 0.0  # how far the host has waited
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.queued_ms += MATMUL_MS if func in SAVED_OPS else OTHER_MS
        return out

    def synchronize(self, device: object = None) -> None:
        self.syncs += 1
        self.done_ms = self.queued_ms


def _event_class(gpu: _VirtualGpu) -> type:
    class Event:
        def __init__(self, enable_timing: bool = False, **_: object) -> None:
            self.timing = enable_timing
            self.at: float | None = None

        def record(self, stream: object = None) -> None:
            self.at = gpu.queued_ms

        def synchronize(self) -> None:
            assert self.at is not None, "synchronized on an event never recorded"
            gpu.syncs += 1
            gpu.done_ms = max(gpu.done_ms, self.at)

        def elapsed_time(self, end: Event) -> float:
            assert self.timing and end.timing, "elapsed_time needs Event(enable_timing=True)"
            assert self.at is not None and end.at is not None, "an event was never recorded"
            assert gpu.done_ms >= max(self.at, end.at), \
                "elapsed_time read before the GPU finished the work (cudaErrorNotReady)"
            return end.at - self.at

    return Event


class LaunchBound(nn.Module):
    """A tiny matmul (slow on the emulated GPU) and a large sin (slow on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("big", torch.randn(1 << 20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.sin(self.big).sum() * 0


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> _VirtualGpu:
    gpu = _VirtualGpu()
    monkeypatch.setattr(profile_mod, "_on_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Event", _event_class(gpu))
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    return gpu


def test_cuda_times_are_the_gpus_work_read_with_one_sync_per_step(gpu: _VirtualGpu) -> None:
    n, repeats = 6, 2
    model = nn.Sequential(*[LaunchBound() for _ in range(n)])
    x = torch.randn(4, 4)
    with gpu:
        prof = ck.profile(model, x, repeats=repeats)
    # one sync for the memory pass's op times, one per timed step: none per block or op
    assert gpu.syncs == 1 + repeats
    for b in prof.blocks:
        # the block's virtual GPU time: one addmm and a few cheap ops, not the host's sin
        assert MATMUL_MS / 1e3 <= b.forward_s <= (MATMUL_MS + 20 * OTHER_MS) / 1e3
        # the matmul is nearly all of the GPU's time, so selective keeps nearly all of it
        assert b.selective_forward_s >= 0.97 * b.forward_s
    assert prof.step_s >= n * MATMUL_MS / 1e3


def test_cpu_keeps_host_clocks() -> None:
    """Without CUDA no event is made and nothing synchronizes: the host's clocks time the
    blocks (process time) and the ops (wall time)."""
    model = nn.Sequential(*[LaunchBound() for _ in range(2)])
    made, syncs = [], []
    orig_event, orig_sync = torch.cuda.Event, torch.cuda.synchronize
    try:
        torch.cuda.Event = lambda *a, **k: made.append(1)  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: syncs.append(1)  # type: ignore[assignment]
        prof = ck.profile(model, torch.randn(4, 4), repeats=1)
    finally:
        torch.cuda.Event, torch.cuda.synchronize = orig_event, orig_sync  # type: ignore[assignment]
    assert not made and not syncs
    assert len(prof.blocks) == 2
