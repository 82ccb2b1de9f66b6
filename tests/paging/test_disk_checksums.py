"""The disk tier's checksums on pages of several stripes, through the optimizer: what the copy
pass records is the page checksum of the bytes in the spill file (XXH3-64 of each 4 MiB stripe,
then of their digests), and a byte changed in any stripe is refused by the step, which then
finishes with the intact bytes."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from tightfit.integrity.checksums import CHUNK, STRIPE, CorruptStateError, page_checksum
from tightfit.optim.adamw import PagedAdamW

PAGE = 2 * STRIPE + (64 << 10)  # three stripes a page, the last short; each copied and hashed
# on whichever thread takes it

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _file_bytes(opt: PagedAdamW, page) -> bytes:  # noqa: ANN001 - a layout Page
    path = os.path.join(opt.memory_stats()["spill_dir"], f"group{page.group}.spill")
    with open(path, "rb") as f:
        f.seek(page.spill_offset)
        return f.read(page.nbytes)


def _by_definition(data: bytes) -> int:
    """A disk page's checksum written out: XXH3-64 of each 256 KiB chunk, then of the digests."""
    digests = [xxhash.xxh3_64_intdigest(data[a : a + CHUNK]) for a in range(0, len(data), CHUNK)]
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


def _flip(opt: PagedAdamW, page, pos: int) -> None:  # noqa: ANN001
    path = os.path.join(opt.memory_stats()["spill_dir"], f"group{page.group}.spill")
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, page.spill_offset + pos)[0]
        os.pwrite(fd, bytes([byte ^ 0x04]), page.spill_offset + pos)
    finally:
        os.close(fd)


def test_a_changed_byte_in_any_stripe_of_a_disk_page_is_refused(tmp_path) -> None:
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(2 * PAGE // 8, generator=gen)  # AdamW: 8 bytes of state a param
    opt = PagedAdamW([param], lr=1e-2, page_bytes=PAGE, device_budget=PAGE, spill_dir=tmp_path)
    for _ in range(2):  # the second step reads every disk page back and writes it again
        param.grad = torch.randn(param.shape, generator=gen)
        opt.step()
    pages = [p for p in opt.pager.pages if p.tier == "disk"]
    assert pages and all(p.nbytes == PAGE for p in pages)
    for page in pages:  # recorded by the striped copy pass = the definition on the file's bytes
        data = _file_bytes(opt, page)
        assert page.spill_checksum == _by_definition(data)
        as_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert page.spill_checksum == page_checksum(as_tensor)
    page = pages[-1]
    lo, hi = page.segments[0].start, page.segments[0].start + page.segments[0].length
    for pos in (5, STRIPE + 4097, 2 * STRIPE, PAGE - 1):  # stripe 0, 1, 2 (its first, last)
        _flip(opt, page, pos)
        before = param[lo:hi].clone()
        param.grad = torch.randn(param.shape, generator=gen)
        with pytest.raises(CorruptStateError, match=f"page {page.index} .*does not match"):
            opt.step()
        assert torch.equal(param[lo:hi], before), pos  # the bad bytes were never used
        _flip(opt, page, pos)  # the file intact again: the pending step finishes with it
        opt.finish_step()
        assert not torch.equal(param[lo:hi], before), pos
        assert page.spill_checksum == _by_definition(_file_bytes(opt, page)), pos
    opt.close()
