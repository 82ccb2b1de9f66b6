"""Checksums on disk-tier pages: a flipped bit, 4 KiB of NaN or of random bytes in a spill page is
refused on every way back (the sweep, a restore, a state dict), naming the page, its params and
the tier; a write-back that failed leaves the page marked lost, never stale."""

from __future__ import annotations

import os

import pytest
import torch

from tightfit.integrity.checksums import CorruptStateError, page_checksum, zeros_checksum
from tightfit.optim.adamw import PagedAdamW
from tightfit.paging.layout import Page

PAGE = 16 << 10
SIZES = [3000, 5000, 4097, 9000]  # 11 pages; with 4 pages of budget, 7 live on disk

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _setup(tmp_path, steps: int = 2, budget: int | None = 4 * PAGE
           ) -> tuple[list[torch.Tensor], PagedAdamW]:  # fmt: skip
    params = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW(params, lr=1e-2, page_bytes=PAGE, device_budget=budget, spill_dir=tmp_path)
    for _ in range(steps):
        _grads(params)
        opt.step()
    return params, opt


def _grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)


def _disk_page(opt: PagedAdamW) -> Page:
    return [p for p in opt.pager.pages if p.tier == "disk"][-2]


def _corrupt(opt: PagedAdamW, page: Page, offset: int, data: bytes) -> None:
    """Change bytes of ``page`` in its spill file as something outside the optimizer would."""
    path = os.path.join(opt.memory_stats()["spill_dir"], f"group{page.group}.spill")
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, page.spill_offset + offset)
    finally:
        os.close(fd)


def _flip_exponent_bit(opt: PagedAdamW, page: Page) -> None:
    off = page.arrays["exp_avg_sq"][0] + 4 * 100 + 3  # the high byte of one fp32 value
    path = os.path.join(opt.memory_stats()["spill_dir"], f"group{page.group}.spill")
    with open(path, "rb") as f:
        f.seek(page.spill_offset + off)
        byte = f.read(1)[0]
    _corrupt(opt, page, off, bytes([byte ^ 0x08]))  # one exponent bit: a value off by 2^±16


CORRUPTIONS = {
    "one-exponent-bit": lambda opt, page: _flip_exponent_bit(opt, page),
    "4KiB-of-NaN": lambda opt, page: _corrupt(
        opt, page, 4096, torch.full((1024,), float("nan")).numpy().tobytes()),
    "4KiB-random": lambda opt, page: _corrupt(opt, page, 0, os.urandom(4096)),
}


def _assert_names_the_page(exc: CorruptStateError, page: Page) -> None:
    message = str(exc)
    assert f"page {page.index} (param group {page.group}: param {page.segments[0].param}" in message
    assert "disk tier" in message and f"group{page.group}.spill" in message
    assert "does not match its checksum" in message and "was not used" in message


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_corrupt_spill_page_is_refused_by_the_step(tmp_path, corrupt) -> None:
    params, opt = _setup(tmp_path)
    page = _disk_page(opt)
    corrupt(opt, page)
    seg = page.segments[0]
    before = params[seg.param][seg.start : seg.start + seg.length].clone()
    _grads(params)
    with pytest.raises(CorruptStateError) as info:
        opt.step()
    _assert_names_the_page(info.value, page)
    # the bad state was never used: the page's params are as they were
    assert torch.equal(params[seg.param][seg.start : seg.start + seg.length], before)
    with pytest.raises(CorruptStateError):  # and it stays refused, never silently used later
        opt.finish_step()
    opt.close()


def test_a_corrupt_page_is_refused_by_a_restore_and_by_state_dict(tmp_path) -> None:
    params, opt = _setup(tmp_path, budget=None)
    opt.pager.evict_bytes(opt.pager.device_bytes // 2, "test: a spike")  # written to disk
    page = _disk_page(opt)
    _flip_exponent_bit(opt, page)
    with pytest.raises(CorruptStateError) as info:
        opt.state_dict()
    _assert_names_the_page(info.value, page)
    with pytest.raises(CorruptStateError):
        opt.pager.restore_bytes(None, "test: room again")  # disk -> device reads it too
    assert page.tier == "disk"  # refused: not brought back
    opt.close()


def test_a_page_that_was_never_written_is_checked_too(tmp_path) -> None:
    params = [torch.randn(n) for n in SIZES]
    opt = PagedAdamW(params, page_bytes=PAGE, device_budget=4 * PAGE, spill_dir=tmp_path)
    opt.pager.materialize()  # placed: the disk pages are zeros nobody wrote
    page = _disk_page(opt)
    assert page.spill_checksum == zeros_checksum(page.nbytes)
    _corrupt(opt, page, 123, b"\x01")
    _grads(params)
    with pytest.raises(CorruptStateError, match=f"page {page.index} "):
        opt.step()  # the first step reads every disk page
    opt.close()


def test_a_failed_write_back_marks_the_page_lost_not_stale(tmp_path, monkeypatch) -> None:
    params, opt = _setup(tmp_path)
    page = _disk_page(opt)
    spill = opt.pager.spill
    real = spill.check
    calls = {"n": 0}

    def check(group: int, offset: int, nbytes: int) -> None:
        if offset == page.spill_offset:
            calls["n"] += 1
            if calls["n"] == 2:  # its load passes; its write-back finds the disk failing
                raise OSError(5, "Input/output error (injected)")
        real(group, offset, nbytes)

    monkeypatch.setattr(spill, "check", check)
    _grads(params)
    with pytest.raises(OSError, match="injected"):
        opt.step()
    assert page.updated_step == opt._step_id and page.spill_lost is not None
    with pytest.raises(CorruptStateError, match="is lost: its write-back failed"):
        opt.state_dict()  # the old bytes are still in the file, and are not handed out
    opt.finish_step()  # the other pages of the step; the lost one was done, and is skipped
    _grads(params)
    with pytest.raises(CorruptStateError, match="is lost"):
        opt.step()  # a later update never uses the stale bytes
    opt.close()


def test_clean_pages_pass_through_evictions_and_restores(tmp_path) -> None:
    params, opt = _setup(tmp_path, steps=3)
    store = opt.pager
    for _ in range(2):
        store.restore_bytes(None, "test")
        _grads(params)
        opt.step()
        store.evict_bytes(store.device_bytes // 2, "test")
        _grads(params)
        opt.step()
    for page in store.pages:
        if page.tier == "disk":
            assert page_checksum(store.read_page(page)) == page.spill_checksum
    opt.close()
