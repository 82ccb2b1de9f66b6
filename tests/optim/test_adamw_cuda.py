"""PagedAdamW on CUDA: device / pinned host / disk tiers, side-stream copies, torch parity."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW

pytestmark = pytest.mark.cuda
PAGE = 256 << 10
SIZES = [1, 7, 4097, 1_000_003]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _budgets(state_bytes: int) -> dict[str, dict]:
    return {
        "unlimited": {},
        "one_page": {"device_budget": PAGE},
        "30%_host": {"device_budget": int(0.3 * state_bytes)},
        "30%_host_and_disk": {"device_budget": int(0.3 * state_bytes),
                              "host_budget": int(0.3 * state_bytes)},
    }


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%_host", "30%_host_and_disk"])
@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_cuda_matches_torch_fused(paged_cls, torch_cls, budget) -> None:
    dev = torch.device("cuda")
    ref = [torch.randn(n, device=dev) for n in SIZES]
    ours = [p.clone() for p in ref]
    kw = _budgets(8 * sum(SIZES))[budget]
    ref_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt = paged_cls(ours, lr=1e-2, weight_decay=0.1, page_bytes=PAGE, **kw)
    for step in range(20):
        for r, o in zip(ref, ours):
            r.grad = torch.randn_like(r)
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


def test_cuda_steps_do_not_synchronize() -> None:
    """Host-tier streaming runs on a side stream with events: no synchronizing call."""
    params = [torch.randn(300_000, device="cuda") for _ in range(4)]
    opt = PagedAdamW(params, page_bytes=PAGE, device_budget=4 * PAGE)
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


def test_cuda_state_dict_both_ways_and_bf16() -> None:
    ref = [torch.randn(5000, device="cuda"), torch.randn(70_000, device="cuda")]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True)
    for p in ref:
        p.grad = torch.randn_like(p)
    ref_opt.step()
    ours = [p.clone() for p in ref]
    opt = PagedAdamW(ours, amsgrad=True, page_bytes=PAGE, device_budget=PAGE,
                     host_budget=PAGE)
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
    p16 = torch.randn(10_000, device="cuda", dtype=torch.bfloat16)
    with PagedAdamW([p16], page_bytes=PAGE, device_budget=PAGE) as opt16:
        p16.grad = torch.randn_like(p16)
        opt16.step()
        assert p16.dtype == torch.bfloat16
        assert opt16.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
