"""Slabs (the CPU device tier) and joined views: one kernel view per param, memory returned."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.paging import slab as slab_mod
from tightfit.paging.layout import StateSpec, build_pages
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.slab import Slab, page_runs, slabs_supported
from tightfit.paging.store import PageStore

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
    pytest.mark.skipif(not slabs_supported(), reason="slabs need madvise (Linux)"),
]
MiB = 1 << 20


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s OS pages that are in RAM (``mincore``), the pages it touches counted."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.nbytes) // page) * page
    vec = ctypes.create_string_buffer((hi - lo) // page)
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * page


def _count_views(opt: PagedAdamW) -> list[int]:
    """Wrap ``opt._update`` to record how many views each call gets."""
    calls: list[int] = []
    update = opt._update

    def spy(group, params, grads, states, steps):  # noqa: ANN001, ANN202
        calls.append(len(params))
        return update(group, params, grads, states, steps)

    opt._update = spy  # type: ignore[method-assign]
    return calls


def _grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("slabs", [True, False])
def test_fully_resident_step_gives_the_kernel_one_view_per_param(monkeypatch, slabs) -> None:
    monkeypatch.setattr(PagedAdamW, "_slabs", slabs)
    params = [torch.randn(n) for n in (300_000, 5, 70_000)]  # the first spans several pages
    opt = PagedAdamW(params, page_bytes=256 << 10)
    assert len(opt.pager.pages) >= 4
    calls = _count_views(opt)
    _grads(params, 0)
    opt.step()
    segments = sum(len(p.segments) for p in opt.pager.pages)
    # slab: torch.optim.AdamW's own call shape; one buffer per page (CUDA's format): a view each
    assert calls == ([3] if slabs else [segments])
    opt.close()


def test_views_are_joined_only_within_a_param_and_a_resident_run(monkeypatch) -> None:
    monkeypatch.setattr(PagedAdamW, "_slabs", True)
    params = [torch.randn(n) for n in (300_000, 200_000)]
    ref = [p.clone() for p in params]
    opt = PagedAdamW(params, page_bytes=256 << 10, device_budget=1 * MiB)  # part streams
    torch_opt = torch.optim.AdamW(ref, foreach=False)
    calls = _count_views(opt)
    for step in range(3):
        _grads(params, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    streamed = sum(p.tier == "disk" for p in opt.pager.pages)
    assert streamed > 0
    # each streamed page is its own call with one view; resident runs are joined per param
    assert sum(1 for c in calls if c == 1) >= 3 * streamed
    for p, r in zip(params, ref):
        assert ((p - r).norm() / r.norm()).item() <= 1e-6
    opt.close()


def test_evicted_slab_pages_leave_rss_and_come_back_intact(monkeypatch) -> None:
    monkeypatch.setattr(PagedAdamW, "_slabs", True)
    n = 4_000_000  # 32 MiB of AdamW state in 1 MiB pages
    param = torch.randn(n)
    ref = param.clone()
    opt = PagedAdamW([param], page_bytes=1 * MiB)
    torch_opt = torch.optim.AdamW([ref], foreach=False)
    _grads([param], 0)
    _grads([ref], 0)
    opt.step()
    torch_opt.step()
    slab = next(iter(opt.pager._slabs.values()))
    in_ram = lambda: sum(_resident_bytes(a) for a in slab.arrays.values())  # noqa: E731
    assert in_ram() >= 30 * MiB  # every page touched by the step
    opt.pager.limit_device(4 * MiB, "test")  # ~2 pages resident + the 2-page window
    stats = opt.memory_stats()
    assert stats["device_bytes"] <= 4 * MiB
    # what stays in RAM: the resident pages (the window slots are separate buffers)
    assert in_ram() <= stats["resident_bytes"] + 2 * mmap.PAGESIZE * len(slab.arrays)
    opt.pager.restore_bytes(None, "test")  # back into the slab, read from the spill file
    for step in range(1, 3):
        _grads([param], step)
        _grads([ref], step)
        opt.step()
        torch_opt.step()
    assert ((param - ref).norm() / ref.norm()).item() <= 1e-6
    opt.close()


def test_release_never_zeroes_a_resident_neighbour() -> None:
    # pages of ~1 KiB: several pages share each 4 KiB OS page of every array
    specs = [StateSpec("exp_avg", torch.float32), StateSpec("exp_avg_sq", torch.float32)]
    pages = build_pages(0, [5000, 3, 2000], [torch.float32] * 3, specs, 1, 1024, 0)
    (run,) = page_runs(pages)
    slab = Slab(run)
    for page in run:
        for k, view in enumerate(slab.views(page).values()):
            view.fill_(page.index + 0.5 * k + 1)
    resident = {p.index for p in run if p.index % 20 < 3}  # evicted stretches of 17 pages
    freed = 0
    for page in run:
        page.tier = "device" if page.index in resident else "disk"
    for page in run:
        if page.index not in resident:
            freed += slab.release(page, lambda q: q.tier == "device")
    assert freed > 0  # OS pages covered only by evicted pages went back
    for page in run:
        if page.index in resident:
            for k, view in enumerate(slab.views(page).values()):
                assert torch.all(view == page.index + 0.5 * k + 1), page.index
    slab.close()


def test_slabs_are_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="slabs=True needs params on the CPU"):
        PageStore(torch.device("meta"), PagingOptions(1 << 20), slabs=True)


def test_bf16_params_update_a_page_run_at_a_time(monkeypatch) -> None:
    # bf16 params step through one page-sized fp32 scratch (optim/upcast.py, issue 25
    # finding 7), not a whole-param fp32 copy: every element once, no call a whole param
    monkeypatch.setattr(PagedAdamW, "_slabs", True)
    params = [torch.randn(300_000).bfloat16() for _ in range(2)]
    opt = PagedAdamW(params, page_bytes=256 << 10)
    sizes: list[int] = []
    update = opt._update

    def spy(group, views, grads, states, steps):  # noqa: ANN001, ANN202
        sizes.append(sum(v.numel() for v in views))
        return update(group, views, grads, states, steps)

    opt._update = spy  # type: ignore[method-assign]
    _grads(params, 0)
    opt.step()
    assert sum(sizes) == 600_000 and len(sizes) > 2 and max(sizes) < 300_000
    opt.close()


def test_a_refused_mapping_falls_back_to_one_buffer_per_page(monkeypatch) -> None:
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(PagedAdamW, "_slabs", True)
    monkeypatch.setattr(slab_mod.mmap, "mmap", refuse)
    params = [torch.randn(100_000)]
    ref = [params[0].clone()]
    opt = PagedAdamW(params, page_bytes=64 << 10, device_budget=256 << 10)
    torch_opt = torch.optim.AdamW(ref, foreach=False)
    assert opt.pager._slabs == {}
    for step in range(3):
        _grads(params, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    assert ((params[0] - ref[0]).norm() / ref[0].norm()).item() <= 1e-6
    assert all(p.buf is not None for p in opt.pager.pages if p.tier == "device")
    opt.close()


@pytest.mark.skipif(
    slab_mod._MAP_NORESERVE == 0,
    reason="MAP_NORESERVE's value is only known for x86_64/aarch64",
)
def test_a_slab_larger_than_ram_is_mapped_without_reserving_it() -> None:
    # 64 GiB of virtual slab on a machine with less RAM: only touched pages would cost memory
    specs = [StateSpec("exp_avg", torch.float32)]
    pages = build_pages(0, [16 << 30], [torch.float32], specs, 1, 1 << 30, 0)
    slab = Slab(page_runs(pages)[0])
    assert slab.arrays["exp_avg"].numel() == 16 << 30
    slab.close()


def test_a_group_added_after_the_first_step_gets_its_own_slab(monkeypatch) -> None:
    monkeypatch.setattr(PagedAdamW, "_slabs", True)
    first, later = [torch.randn(50_000)], [torch.randn(30_000), torch.randn(9)]
    ref = [p.clone() for p in first + later]
    opt = PagedAdamW(first, page_bytes=64 << 10)
    torch_opt = torch.optim.AdamW(ref[:1], foreach=False)
    _grads(first, 0)
    _grads(ref[:1], 0)
    opt.step()
    torch_opt.step()
    opt.add_param_group({"params": later, "lr": 3e-3})
    torch_opt.add_param_group({"params": ref[1:], "lr": 3e-3})
    assert len(set(opt.pager._slabs.values())) == 2
    for step in range(1, 4):
        _grads(first + later, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    for p, r in zip(first + later, ref):
        assert ((p - r).norm() / r.norm()).item() <= 1e-6
    opt.close()
