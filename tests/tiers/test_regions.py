"""Region pools of the next tier, and the copy engine's one-way moves (offloaded activations)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tightfit.tiers.copy import CopyEngine
from tightfit.tiers.regions import PAGE, RegionPool, TierFullError, disk_pool, measure_tier
from tightfit.tiers.spill import SpillArea, release_range


def _memory_pool(grow: int, limit: int | None = None) -> tuple[RegionPool, list[int]]:
    made: list[int] = []

    def make(index: int, nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    return RegionPool("host", make, grow, limit, "test memory"), made


def test_regions_are_page_aligned_reused_and_coalesced() -> None:
    pool, made = _memory_pool(16 * PAGE)
    a, b, c = pool.take(1), pool.take(PAGE + 1), pool.take(3 * PAGE)
    assert [r.offset for r in (a, b, c)] == [0, PAGE, 3 * PAGE]
    assert [r.view.numel() for r in (a, b, c)] == [1, PAGE + 1, 3 * PAGE]
    assert pool.used_bytes == 6 * PAGE and made == [16 * PAGE]
    pool.give(a)
    pool.give(b)  # a and b join: a 3-page region fits where they were
    d = pool.take(3 * PAGE)
    assert (d.chunk, d.offset) == (0, 0)
    for r in (c, d):
        pool.give(r)
    assert pool.used_bytes == 0 and pool.peak_used_bytes == 6 * PAGE
    # the same takes again (a training step repeats itself) need no new chunk
    for _ in range(3):
        regions = [pool.take(n) for n in (5000, 20_000, 6 * PAGE)]
        for r in regions:
            pool.give(r)
    assert pool.chunks_made == 1
    views = pool.covering([pool.take(PAGE), pool.take(2 * PAGE)])
    assert len(views) == 1 and views[0].numel() == 3 * PAGE


def test_a_new_chunk_when_full_and_the_budget_binds() -> None:
    pool, made = _memory_pool(4 * PAGE, limit=6 * PAGE)
    pool.take(4 * PAGE)
    r = pool.take(2 * PAGE)  # the first chunk is full: a second, within the budget
    assert r.chunk == 1 and pool.capacity_bytes == 6 * PAGE and made == [4 * PAGE, 2 * PAGE]
    with pytest.raises(TierFullError, match=r"offload tier 'host' \(test memory\): 4096 more "
                                            r"bytes would pass its budget of 24576 bytes"):
        pool.take(1)
    assert pool.chunks_made == 2  # the refusal changed nothing


def test_reserve_grows_by_what_is_missing_and_close_frees_every_chunk() -> None:
    freed: list[int] = []
    made: list[int] = []

    def make(index: int, nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = RegionPool("host", make, 2 * PAGE, 8 * PAGE, "test memory", freed.append,
                      growth=0.0)
    pool.take(2 * PAGE)  # the first chunk
    pool.reserve(5 * PAGE)  # 3 pages missing: one chunk of exactly that
    assert made == [2 * PAGE, 3 * PAGE]
    assert [pool.take(PAGE).chunk for _ in range(3)] == [1, 1, 1]  # no new chunk
    pool.take(PAGE)  # growth 0: a chunk of just what the region needs
    assert made[-1] == PAGE
    with pytest.raises(TierFullError, match="would pass its budget"):
        pool.reserve(9 * PAGE)
    assert pool.chunks_made == 3  # refused whole
    pool.close()
    assert freed == [0, 1, 2]


def test_disk_pool_reserves_its_file_and_names_a_full_disk(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    spill = SpillArea(tmp_path)
    pool = disk_pool(spill, 64 * PAGE, None)
    region = pool.take(10)
    path = os.path.join(spill.folder, "group0.spill")
    st = os.stat(path)
    assert st.st_size == 64 * PAGE and st.st_blocks * 512 >= 64 * PAGE  # reserved, not sparse
    region.view.copy_(torch.arange(10, dtype=torch.uint8))
    release_range(pool.covering([region])[0])  # synced to the file, dropped from RAM
    with open(path, "rb") as f:
        assert f.read(10) == bytes(range(10))
    spill.close()

    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    spill = SpillArea(tmp_path)
    pool = disk_pool(spill, 64 * PAGE, None)
    with pytest.raises(TierFullError, match=rf"offload tier 'disk' \(spill folder {tmp_path}.*"
                                            rf"no room for {64 * PAGE} bytes"):
        pool.take(10)
    assert pool.chunks_made == 0
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".spill")]
    spill.close()


def test_one_way_moves_keep_order_and_bytes(tmp_path) -> None:  # noqa: ANN001
    engine = CopyEngine()
    spill = SpillArea(tmp_path)
    pool = disk_pool(spill, 256 * PAGE, None)
    try:
        src = torch.randn(50_000)
        region = pool.take(src.nbytes)
        raw = src.view(torch.uint8)
        engine.retire(engine.offload(raw, region.view))
        released = engine.then(lambda: release_range(region.view))
        back = torch.empty_like(raw)
        engine.wait(engine.fetch(region.view, back))  # queued behind the release
        released.result()
        assert torch.equal(back.view(torch.float32), src)
        bandwidth, latency = measure_tier(engine, pool, torch.device("cpu"), nbytes=1 << 20)
        assert bandwidth > 0 and latency >= 0
    finally:
        engine.close()
        spill.close()
