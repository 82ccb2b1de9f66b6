"""PagedAdamW / PagedAdam against torch.optim.AdamW / Adam: numerics under every budget."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW

from ..tiers.counting import count_copies

PAGE = 32 << 10
SIZES = [1, 7, 4097, 30_011]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _groups(params: list[torch.Tensor]) -> list[dict]:
    # two groups with their own hyperparameters; amsgrad only in the second (mixed per group)
    return [
        {"params": [params[0], params[2]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [params[1], params[3]], "lr": 5e-3, "weight_decay": 0.0, "amsgrad": True,
         "betas": (0.8, 0.99)},
    ]


def _budget(kind: str, state_bytes: int, page: int) -> int | None:
    return {"unlimited": None, "one_page": page, "30%": int(0.3 * state_bytes)}[kind]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("slabs", [None, False], ids=["default", "page-buffers"])
@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%"])
@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_matches_torch_over_50_steps(monkeypatch, paged_cls, torch_cls, budget, slabs) -> None:
    # default: slabs on the CPU; page-buffers: one buffer per page, the format CUDA uses
    monkeypatch.setattr(PagedAdamW, "_slabs", slabs)
    _compare(monkeypatch, paged_cls, torch_cls, budget, SIZES, PAGE)


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%"])
@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_matches_torch_1m_params(monkeypatch, paged_cls, torch_cls, budget) -> None:
    _compare(monkeypatch, paged_cls, torch_cls, budget, [1, 7, 4097, 1_000_003], 1 << 20)


def _compare(monkeypatch, paged_cls, torch_cls, budget: str, sizes: list[int], page: int) -> None:
    count_copies(monkeypatch)
    ref = [torch.randn(n) for n in sizes]
    ours = [p.clone() for p in ref]
    state_bytes = sum(sizes[i] * 8 for i in (0, 2)) + sum(sizes[i] * 12 for i in (1, 3))
    limit = _budget(budget, state_bytes, page)
    ref_opt = torch_cls(_groups(ref), foreach=False)
    opt = paged_cls(_groups(ours), page_bytes=page, device_budget=limit)
    engine = opt.pager.engine
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) for o in (ref_opt, opt)]
    gen = torch.Generator().manual_seed(1)
    for step in range(50):
        for r, o in zip(ref, ours):
            g = torch.randn(r.shape, generator=gen) * (1.0 if step % 3 else 1e-3)
            r.grad, o.grad = g, g.clone()
        before, copied = opt.memory_stats(), engine.counts()
        ref_opt.step()
        opt.step()
        after = opt.memory_stats()
        for s in scheds:
            s.step()
        # the sweep moves exactly 2 x the non-resident bytes: each one in and out once
        moved_in = after["bytes_paged_in"] - before["bytes_paged_in"]
        moved_out = after["bytes_paged_out"] - before["bytes_paged_out"]
        assert moved_in == moved_out == after["disk_bytes"]
        # ... and so does the copy engine, counting what it copied
        assert [b - a for a, b in zip(copied, engine.counts())] == [after["disk_bytes"]] * 2 + [0]
        assert after["peak_device_bytes"] <= (opt.pager.device_budget or after["state_bytes"])
    for r, o in zip(ref, ours):
        assert _rel(o, r) <= 1e-6
    ref_sd, sd = ref_opt.state_dict(), opt.state_dict()
    for i in range(len(sizes)):
        assert sd["state"][i]["step"].item() == 50
        for name, value in ref_sd["state"][i].items():
            if name != "step":
                assert _rel(sd["state"][i][name], value) <= 1e-6, name
    if budget == "unlimited":
        assert after["disk_bytes"] == 0 and after["bytes_paged_in"] == 0
        assert engine.counts() == (0, 0, 0)
    else:
        assert after["disk_bytes"] > 0
        assert after["device_bytes"] <= limit
    opt.close()


def test_fused_path_equals_torch_fused() -> None:
    """Same kernel on the same numbers: the paged step is torch's fused step."""
    ref = [torch.randn(n) for n in (5, 3000, 70_001)]
    ours = [p.clone() for p in ref]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, fused=True)
    opt = PagedAdamW(ours, lr=1e-2, weight_decay=0.05, page_bytes=64 << 10,
                     device_budget=192 << 10)
    for _ in range(10):
        for r, o in zip(ref, ours):
            r.grad = torch.randn(r.shape)
            o.grad = r.grad.clone()
        ref_opt.step()
        opt.step()
    for r, o in zip(ref, ours):
        assert _rel(o, r) <= 1e-7
    opt.close()


@pytest.mark.parametrize("kernel", [{"fused": False}, {"fused": True}, {"foreach": True}])
def test_maximize_and_closure(kernel: dict) -> None:
    ref = torch.randn(300, requires_grad=True)
    ours = ref.detach().clone().requires_grad_(True)
    target = torch.randn(300)
    ref_opt = torch.optim.AdamW([ref], lr=0.1, maximize=True, foreach=False)
    opt = PagedAdamW([ours], lr=0.1, maximize=True, **kernel)
    for _ in range(5):
        for p, o in ((ref, ref_opt), (ours, opt)):
            def closure(p=p, o=o):
                o.zero_grad()
                loss = -((p - target) ** 2).sum()
                loss.backward()
                return loss
            loss = o.step(closure)
        assert isinstance(loss, torch.Tensor)
    assert _rel(ours.detach(), ref.detach()) <= 1e-6
    opt.close()


def test_params_without_grad_are_skipped_and_not_paged(monkeypatch) -> None:
    count_copies(monkeypatch)
    a, b = torch.randn(40_000), torch.randn(40_000)
    a0, b0 = a.clone(), b.clone()
    # 64 KiB pages: a and b each fill ~5 pages; 2 pages of budget: everything streams
    opt = PagedAdamW([a, b], lr=0.1, page_bytes=64 << 10, device_budget=128 << 10)
    a.grad = torch.randn_like(a)
    opt.step()
    stats = opt.memory_stats()
    assert torch.equal(b, b0) and not torch.equal(a, a0)
    assert b not in opt.state and opt.state[a]["step"].item() == 1
    assert set(opt.state_dict()["state"]) == {0}
    pages_of_a = [p for p in opt.pager.pages if any(s.param == 0 for s in p.segments)]
    # only pages holding a's state moved (b's pages hold no gradient this step)
    assert stats["bytes_paged_in"] == stats["bytes_paged_out"] == sum(p.nbytes for p in pages_of_a)
    assert opt.pager.engine.counts() == (stats["bytes_paged_in"], stats["bytes_paged_out"], 0)
    opt.close()


def test_bf16_params_with_fp32_state() -> None:
    p = torch.randn(5000).bfloat16()
    master = p.float()
    opt = PagedAdamW([p], lr=1e-2, weight_decay=0.1, page_bytes=16 << 10, device_budget=32 << 10)
    ref_opt = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(10):
        g = torch.randn(5000).bfloat16()
        p.grad, master.grad = g, g.float()
        opt.step()
        ref_opt.step()
        master.copy_(master.bfloat16().float())  # the param is stored in bf16 after each step
    assert p.dtype == torch.bfloat16
    assert all(page.dtype == torch.bfloat16 for page in opt.pager.pages)
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
    # same fp32 math rounded once per step; kernels may differ by one bf16 rounding step
    assert ((p.float() - master).abs() <= master.abs() * 2**-7).all()
    assert _rel(opt.state_dict()["state"][0]["exp_avg_sq"],
                ref_opt.state_dict()["state"][0]["exp_avg_sq"]) <= 1e-5
    opt.close()


def test_add_param_group_zero_grad_and_clipping() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    ref_model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    ref_model.load_state_dict(model.state_dict())
    opt = PagedAdamW(model[0].parameters(), lr=1e-2, page_bytes=8 << 10, device_budget=16 << 10)
    ref_opt = torch.optim.AdamW(ref_model[0].parameters(), lr=1e-2, foreach=False)
    opt.add_param_group({"params": model[1].parameters(), "lr": 3e-2})
    ref_opt.add_param_group({"params": ref_model[1].parameters(), "lr": 3e-2})
    x = torch.randn(8, 64)
    for _ in range(5):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            o.step()
    assert all(p.grad is None for p in model.parameters()) is False
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert _rel(a.detach(), b.detach()) <= 1e-6
    opt.close()


def test_add_param_group_after_paging_started(monkeypatch) -> None:
    count_copies(monkeypatch)
    a = torch.randn(20_000)
    b = torch.randn(9_000)
    ref_a, ref_b = a.clone(), b.clone()
    opt = PagedAdamW([a], lr=1e-2, page_bytes=16 << 10, device_budget=48 << 10)
    ref = torch.optim.AdamW([ref_a], lr=1e-2, foreach=False)
    for step in range(6):
        if step == 3:  # the new group's pages are placed under the same budget
            opt.add_param_group({"params": [b], "lr": 2e-2})
            ref.add_param_group({"params": [ref_b], "lr": 2e-2})
        params = [a] if step < 3 else [a, b]
        refs = [ref_a] if step < 3 else [ref_a, ref_b]
        for p, r in zip(params, refs):
            r.grad = torch.randn(r.shape)
            p.grad = r.grad.clone()
        before, loaded = opt.memory_stats(), opt.pager.engine.loaded
        opt.step()
        ref.step()
        after = opt.memory_stats()
        moved = after["bytes_paged_in"] - before["bytes_paged_in"]
        assert moved == after["state_bytes"] - after["resident_bytes"]
        assert opt.pager.engine.loaded - loaded == moved  # the engine copied just that
        assert after["peak_device_bytes"] <= 48 << 10
    assert _rel(a, ref_a) <= 1e-6 and _rel(b, ref_b) <= 1e-6
    opt.close()
