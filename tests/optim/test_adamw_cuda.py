"""PagedAdamW on CUDA: device / pinned host / disk tiers, side-stream copies, torch parity.

Each test runs twice: on a GPU (``cuda``, skipped without one) and under the strict CUDA
emulation on the CPU (``emulated``: ``tests/tiers/strict_cuda.py``, the store built as on an
accelerator with CUDA's copy engine; smaller sizes and fewer steps, the CPU being slow under
it). The checks are the same: torch parity, the bytes moved, the memory a step leaves, no
synchronizing call in a step after the first, pinned host pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.tiers.copy import CudaCopyEngine

from ..tiers.counting import count_copies

PAGE = 256 << 10


@dataclass
class Dev:
    device: torch.device
    sizes: list[int]
    steps: int
    page: int


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def dev(request, monkeypatch) -> Dev:  # noqa: ANN001
    if request.param == "cuda":
        return Dev(torch.device("cuda"), [1, 7, 4097, 1_000_003], 20, PAGE)
    request.getfixturevalue("strict_cuda")  # tests/conftest.py
    count_copies(monkeypatch, CudaCopyEngine, emulate_accelerator=True)
    return Dev(torch.device("cpu"), [1, 7, 4097, 100_003], 4, 64 << 10)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _budgets(state_bytes: int, page: int) -> dict[str, dict]:
    return {
        "unlimited": {},
        "one_page": {"device_budget": page},
        "30%_host": {"device_budget": int(0.3 * state_bytes)},
        "30%_host_and_disk": {"device_budget": int(0.3 * state_bytes),
                              "host_budget": int(0.3 * state_bytes)},
    }


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%_host", "30%_host_and_disk"])
@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_cuda_matches_torch_fused(dev, paged_cls, torch_cls, budget) -> None:
    gen = torch.Generator(dev.device).manual_seed(0)
    ref = [torch.randn(n, device=dev.device, generator=gen) for n in dev.sizes]
    ours = [p.clone() for p in ref]
    kw = _budgets(8 * sum(dev.sizes), dev.page)[budget]
    ref_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt = paged_cls(ours, lr=1e-2, weight_decay=0.1, page_bytes=dev.page, **kw)
    for step in range(dev.steps):
        for r, o in zip(ref, ours):
            r.grad = torch.randn(r.shape, device=dev.device, generator=gen)
            o.grad = r.grad.clone()
        ref_opt.step()
        before = opt.memory_stats()
        allocated = torch.cuda.memory_allocated()
        opt.step()
        after = opt.memory_stats()
        non_resident = after["state_bytes"] - after["resident_bytes"]
        moved = (after["bytes_paged_in"] - before["bytes_paged_in"]
                 + after["bytes_paged_out"] - before["bytes_paged_out"])
        assert moved == 2 * non_resident
        if step == 0:
            # the first step allocates our state (+ step counters), nothing else stays
            grown = torch.cuda.memory_allocated() - allocated
            assert grown <= after["device_bytes"] + (1 << 20)
    torch.cuda.synchronize()
    for r, o in zip(ref, ours):
        assert _rel(o, r) <= 1e-6
    s = opt.memory_stats()
    if "device_budget" in kw:
        assert s["peak_device_bytes"] <= kw["device_budget"]
        assert s["host_bytes"] + s["disk_bytes"] == s["state_bytes"] - s["resident_bytes"]
    if "host_budget" in kw:
        assert s["disk_bytes"] > 0 and s["host_bytes"] <= kw["host_budget"]
    for page in opt.pager.pages:
        if page.tier == "host":
            assert page.buf.is_pinned()
    opt.close()


def test_cuda_steps_do_not_synchronize(dev) -> None:
    """Host-tier streaming runs on a side stream with events: no synchronizing call."""
    numel = 300_000 if dev.device.type == "cuda" else 30_000
    params = [torch.randn(numel, device=dev.device) for _ in range(4)]
    opt = PagedAdamW(params, page_bytes=dev.page, device_budget=4 * dev.page)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # first step places pages (allowed to synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert opt.memory_stats()["host_bytes"] > 0
    opt.close()


def test_cuda_state_dict_both_ways_and_bf16(dev) -> None:
    ref = [torch.randn(5000, device=dev.device), torch.randn(70_000, device=dev.device)]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True)
    for p in ref:
        p.grad = torch.randn_like(p)
    ref_opt.step()
    ours = [p.clone() for p in ref]
    opt = PagedAdamW(ours, amsgrad=True, page_bytes=dev.page, device_budget=dev.page,
                     host_budget=dev.page)
    opt.load_state_dict(ref_opt.state_dict())
    for r, o in zip(ref, ours):
        r.grad = torch.randn_like(r)
        o.grad = r.grad.clone()
    ref_opt.step()
    opt.step()
    for r, o in zip(ref, ours):
        assert _rel(o, r) <= 1e-6
    back = torch.optim.AdamW([p.clone() for p in ours], amsgrad=True)
    back.load_state_dict(opt.state_dict())
    assert back.state_dict()["state"][1]["exp_avg"].shape == (70_000,)
    opt.close()
    p16 = torch.randn(10_000, device=dev.device, dtype=torch.bfloat16)
    # a page and its fp32 update copies (8 bytes an element: optim/upcast.py) fit the budget
    with PagedAdamW([p16], page_bytes=dev.page, device_budget=2 * dev.page) as opt16:
        p16.grad = torch.randn_like(p16)
        opt16.step()
        assert p16.dtype == torch.bfloat16
        assert opt16.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
