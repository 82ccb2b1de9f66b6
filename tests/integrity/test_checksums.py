"""The checksums: one flipped bit anywhere changes them, a disk page's striped checksum is the
same whether hashed alone (on several threads) or chunk by chunk while copied, the copy hashes
what landed, a helper thread's error is the caller's, and what is not a page's bytes is refused
by name."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from tightfit.integrity import checksums
from tightfit.integrity.checksums import (
    CHUNK,
    STRIPE,
    checksum,
    copy_and_checksum,
    page_checksum,
    zeros_checksum,
)


def test_any_flipped_bit_changes_the_checksum() -> None:
    data = torch.randn(300_000).view(torch.uint8)  # 1.2 MB: several copy chunks
    clean = checksum(data)
    gen = torch.Generator().manual_seed(0)
    for pos in [0, 1, 4095, 262_143, 262_144, data.numel() - 1,
                *torch.randint(0, data.numel(), (20,), generator=gen).tolist()]:  # fmt: skip
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum(data) != clean, (pos, bit)
            data[pos] ^= 1 << bit
    assert checksum(data) == clean
    assert zeros_checksum(4096) == checksum(torch.zeros(4096, dtype=torch.uint8))


def test_a_page_checksum_is_that_of_its_chunks_digests() -> None:
    import xxhash

    data = torch.randn(50_000).view(torch.uint8)  # 200 kB: one chunk, the plain checksum
    assert page_checksum(data) == checksum(data)
    dst = torch.empty_like(data)
    assert copy_and_checksum(dst, data) == checksum(data) and torch.equal(dst, data)
    data = torch.randn(300_000).view(torch.uint8)  # 1.2 MB: five chunks of one stripe
    raw = data.numpy().tobytes()
    digests = [xxhash.xxh3_64_intdigest(raw[a : a + CHUNK]) for a in range(0, len(raw), CHUNK)]
    want = xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))
    assert page_checksum(data) == want != checksum(data)
    dst = torch.empty_like(data)
    assert copy_and_checksum(dst, data) == want and torch.equal(dst, data)
    with pytest.raises(ValueError, match="bytes to"):
        copy_and_checksum(dst[:10], data)


def test_striped_page_checksum_sees_every_stripe_and_matches_the_copy() -> None:
    src = torch.randn((2 * STRIPE + 12_345) // 4).view(torch.uint8)  # 3 stripes, one partial
    dst = torch.zeros_like(src)
    clean = copy_and_checksum(dst, src)
    assert torch.equal(dst, src) and clean == page_checksum(src) == page_checksum(dst)
    assert clean != checksum(src)  # the digest of the chunks' digests, not the plain one
    for pos in (0, STRIPE - 1, STRIPE, 2 * STRIPE, src.numel() - 1):
        src[pos] ^= 1
        assert page_checksum(src) != clean, pos
        src[pos] ^= 1
    # two stripes swapped: same bytes, other order
    swapped = torch.cat([src[STRIPE : 2 * STRIPE], src[:STRIPE], src[2 * STRIPE :]])
    assert page_checksum(swapped) != clean
    n = 2 * STRIPE + 4096
    assert zeros_checksum(n) == page_checksum(torch.zeros(n, dtype=torch.uint8))


def test_an_error_in_a_helper_thread_is_raised_once_all_stripes_stopped(monkeypatch) -> None:
    src = torch.randn(4 * STRIPE // 4).view(torch.uint8)
    real, calls = checksums._hash_stripe, []

    def flaky(view: memoryview, stripe: slice) -> list[int]:
        calls.append(stripe)
        if len(calls) == 2:
            raise OSError(5, "disk read failed")
        return real(view, stripe)

    monkeypatch.setattr(checksums, "_hash_stripe", flaky)
    with pytest.raises(OSError, match="disk read failed"):
        page_checksum(src)
    ran = len(calls)  # the stripes that ran before the error went on (a helper that had
    time.sleep(0.05)  # not started was cancelled), and none after: nothing touches the page
    assert 2 <= ran <= 4 and len(calls) == ran
    pool, _ = checksums._pool()
    assert pool.submit(lambda: 1).result(timeout=5) == 1  # the pool lives on


def test_the_copy_hashes_chunk_by_chunk_as_the_striped_page_checksum_does() -> None:
    # sizes around the chunk and stripe edges: the streamed stripes must equal the one-shot ones
    for n in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, STRIPE - 1, STRIPE, STRIPE + CHUNK + 7,
              2 * STRIPE + 12_345):  # fmt: skip
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.full_like(src, 0xAA)
        assert copy_and_checksum(dst, src) == page_checksum(src), n
        assert torch.equal(dst, src), n
    # a flipped bit in any chunk, at either edge of a chunk or a stripe, changes it
    src = torch.randn((2 * STRIPE + 12_345) // 4).view(torch.uint8)
    clean = page_checksum(src)
    dst = torch.empty_like(src)
    for pos in (0, CHUNK - 1, CHUNK, 3 * CHUNK + 5, STRIPE - 1, STRIPE, STRIPE + CHUNK,
                2 * STRIPE, src.numel() - 1):  # fmt: skip
        src[pos] ^= 0x10
        assert copy_and_checksum(dst, src) != clean, pos
        assert torch.equal(dst, src), pos
        src[pos] ^= 0x10
    assert copy_and_checksum(dst, src) == clean


def test_the_copy_hashes_what_landed_in_the_destination(monkeypatch) -> None:
    # a fault between a chunk's copy and its hash (memory, a writer of the spill map) is what
    # the hash sees: the checksum is of the destination's bytes, never of the source's
    src = torch.randn(STRIPE // 4 + 1000).view(torch.uint8)
    dst = torch.empty_like(src)
    real, landed = checksums.np.copyto, []

    def copy_then_flip(d, s) -> None:
        real(d, s)
        if len(landed) == 2:  # the third chunk lands with one bit flipped
            d[7] ^= 1
        landed.append(d.size)

    monkeypatch.setattr(checksums.np, "copyto", copy_then_flip)
    got = copy_and_checksum(dst, src)
    monkeypatch.undo()
    assert len(landed) == -(-src.numel() // CHUNK)  # every byte copied, chunk by chunk
    assert got == page_checksum(dst) != page_checksum(src)


def test_a_failed_chunk_copy_is_raised(monkeypatch) -> None:
    # a copy that fails part-way (a disk error under the spill map) goes on to the caller
    # (DiskHome then marks the page lost), never a checksum of half-copied bytes; in whichever
    # stripe (so on whichever thread) it fails, and the failing stripe stops at that chunk
    real = checksums.np.copyto
    for bad in (2, STRIPE // CHUNK + 2, 2 * STRIPE // CHUNK):  # a chunk of stripe 0, 1, 2
        src = torch.randn((2 * STRIPE + CHUNK) // 4).view(torch.uint8)
        dst = torch.empty_like(src)
        base, copied = dst.data_ptr(), []

        def failing(d, s, bad=bad, base=base, copied=copied) -> None:
            chunk = (d.ctypes.data - base) // CHUNK
            if chunk == bad:
                raise OSError(5, "disk read failed")
            real(d, s)
            copied.append(chunk)

        monkeypatch.setattr(checksums.np, "copyto", failing)
        with pytest.raises(OSError, match="disk read failed"):
            copy_and_checksum(dst, src)
        monkeypatch.undo()
        stripe = bad * CHUNK // STRIPE
        first = stripe * STRIPE // CHUNK
        assert [c for c in copied if first <= c < first + STRIPE // CHUNK] == list(
            range(first, bad)), bad  # its stripe stopped at the failed chunk


def test_what_is_not_a_pages_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        checksum(torch.zeros(10))
    with pytest.raises(ValueError, match="non-contiguous"):
        checksum(torch.zeros(10, dtype=torch.uint8)[::2])
    page = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        copy_and_checksum(page, torch.zeros(10, dtype=torch.int16))
    with pytest.raises(ValueError, match="non-contiguous"):
        copy_and_checksum(torch.zeros(20, dtype=torch.uint8)[::2], page)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_hash_pool() -> None:
    src = torch.randn(2 * STRIPE // 4).view(torch.uint8)
    want = page_checksum(src)  # the parent's pool now has a thread
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool thread is not here; a new pool must serve
        code = 0 if page_checksum(src) == want else 1
        os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("page_checksum hung in a forked child")


def test_concurrent_copies_are_each_correct() -> None:
    # several copy workers at once (two optimizers, an offloader) share the hash pool: each
    # page's checksum and bytes are its own
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (2 * STRIPE + 999 * k,), dtype=torch.uint8, generator=gen)
            for k in range(4)]  # fmt: skip
    want = [page_checksum(s) for s in srcs]
    errors: list[str] = []

    def worker(k: int) -> None:
        dst = torch.empty_like(srcs[k])
        for r in range(6):
            got = copy_and_checksum(dst, srcs[k])
            if got != want[k] or not torch.equal(dst, srcs[k]):
                errors.append(f"copy {k} round {r}")
            dst.fill_(0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(srcs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_copy_never_waits_for_a_busy_hash_pool() -> None:
    # the pool's helpers all busy with other work (another copy's stripe): the caller copies
    # every stripe itself and returns, rather than waiting for a helper that has not started
    pool, size = checksums._pool()
    release = threading.Event()
    busy = [pool.submit(release.wait, 30) for _ in range(size)]
    try:
        src = torch.randint(0, 256, (3 * STRIPE,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(copy_and_checksum(dst, src)))
        t.start()
        t.join(timeout=10)
        assert done == [page_checksum(src)] and torch.equal(dst, src)
    finally:
        release.set()
        wait(busy)


def test_copy_threads_counts_a_pages_stripes_up_to_the_pool() -> None:
    from tightfit.integrity.checksums import STRIPE, _pool, copy_threads

    most = 1 + _pool()[1]  # the copy worker and the hash pool's helpers
    assert copy_threads(0) == copy_threads(1) == copy_threads(STRIPE) == 1
    assert copy_threads(STRIPE + 1) == min(2, most)
    assert copy_threads(64 * STRIPE) == min(64, most)
