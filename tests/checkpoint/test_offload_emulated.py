"""Offloaded activations through CUDA's copy engine (side stream, events, pinned host pool),
run on the CPU over fake streams and events: the accelerator path's logic, not CUDA itself
(``test_cuda.py`` runs that on a GPU).

Emulation only: copies run at once, an event must be recorded before anything waits on it,
"pinned" buffers are CPU tensors remembered as pinned, and the device is the CPU.
"""

from __future__ import annotations

import pytest
import torch

import tightfit.checkpoint as ck
from tightfit.checkpoint.plan import OffloadTier

from .conftest import tiny_llama
from .offloaded import MIN_BYTES, install, max_diff, offloader, step

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")


def test_pinned_host_tier_through_the_cuda_engine(strict_cuda) -> None:  # tests/conftest.py
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
        waits = _compute_waits(strict_cuda)
        results = [step(model, batch) for _ in range(3)]
        assert _compute_waits(strict_cuda) > waits  # the compute stream waited on the copies
        assert off.pool.chunks_made == 1 and len(strict_cuda.pinned) == 1  # one pinned buffer, reused
        assert off.bytes_offloaded == 3 * plan.host_bytes
        assert off.pool.used_bytes == 0
    finally:
        ck.disable(model)
    for loss1, g1, peak in results:
        assert torch.equal(loss0, loss1) and max_diff(g0, g1) <= 1e-6
        assert 0.9 * plan.predicted_peak_bytes <= peak <= 1.1 * plan.predicted_peak_bytes


def _compute_waits(emu) -> int:  # noqa: ANN001
    return sum(1 for c in emu.calls if c[:2] == ("wait_event", "compute"))
