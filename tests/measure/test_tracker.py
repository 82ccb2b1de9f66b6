"""MemoryTracker counts live CPU storages exactly."""

from __future__ import annotations

import pytest
import torch

from tightfit.measure.tracker import MemoryTracker


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


def test_external_memory_is_counted_like_a_storage_made_inside() -> None:
    from tightfit.measure.tracker import external_allocated, external_freed

    external_allocated("before", 1000)  # no tracker active: nobody counts it
    with MemoryTracker("cpu") as mt:
        external_allocated("a", 4096)
        external_allocated("b", 100)
        assert mt.current_bytes == 4196
        external_freed("a")
        external_freed("before")  # went live before the tracker: not subtracted
        assert mt.current_bytes == 100
    assert mt.peak_bytes == 4196
    external_freed("b")
    external_allocated("after", 7)  # the tracker is gone: nothing holds on to it
    assert mt.current_bytes == 100


@pytest.mark.parametrize("slabs", [None, False], ids=["slabs", "page-buffers"])
def test_paged_optimizer_state_is_seen_in_either_page_format(monkeypatch, slabs) -> None:
    from tightfit.optim.adamw import PagedAdamW

    monkeypatch.setattr(PagedAdamW, "_slabs", slabs)
    p = torch.randn(100_000)
    p.grad = torch.randn_like(p)
    with MemoryTracker("cpu") as mt:
        opt = PagedAdamW([p], page_bytes=64 << 10)
        opt.step()
        assert mt.current_bytes >= 100_000 * 8  # exp_avg + exp_avg_sq
        opt.close()
        assert mt.current_bytes <= 8  # the step counter may outlive close()


def test_tensors_made_under_not_counted_are_left_out(tmp_path) -> None:
    from tightfit.measure.tracker import not_counted

    path = tmp_path / "f.bin"
    with MemoryTracker("cpu") as mt:
        with not_counted():
            mapped = torch.from_file(str(path), shared=True, size=1 << 20, dtype=torch.uint8)
        assert mt.current_bytes == 0  # a file mapping: disk, not memory a step allocates
        kept = torch.ones(1000)
        assert mt.current_bytes == 4000  # counting resumes after the block
    del mapped, kept
