"""MemoryTracker counts live CPU storages exactly."""

from __future__ import annotations

import pytest
import torch

from tightfit.memory.tracker import MemoryTracker


def test_counts_new_storages_and_frees() -> None:
    with MemoryTracker("cpu") as mt:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        a.add_(1)  # in place: no new memory
        b = a.view(10, 100)  # view: no new memory
        assert mt.current_bytes == 4000
        del a, b
        assert mt.current_bytes == 0
        c = torch.empty(10, dtype=torch.float64)
    assert mt.peak_bytes == 4000
    assert mt.current_bytes == 80
    del c


def test_phases_and_backward() -> None:
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with MemoryTracker("cpu") as mt:
        y = lin(torch.relu(lin(x))).sum()
        mt.mark("backward")
        y.backward()
        del y
    peaks = mt.phase_peaks
    assert set(peaks) == {"forward", "backward"}
    # forward: relu output saved (64*256*4) plus the pre-relu temporary at its peak
    assert peaks["forward"] == 2 * 64 * 256 * 4 + 4
    # what survives: the weight and bias gradients
    assert mt.current_bytes == 256 * 256 * 4 + 256 * 4
    assert mt.peak_bytes == max(peaks.values())


def test_preexisting_tensors_not_counted() -> None:
    p = torch.zeros(1 << 16)
    with MemoryTracker("cpu") as mt:
        p.mul_(2)
        p += 1
    assert mt.peak_bytes == 0


def test_bad_device() -> None:
    with pytest.raises(ValueError, match="cpu"):
        MemoryTracker("meta")
