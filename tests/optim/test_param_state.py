"""``optimizer.state[p]`` of the paged optimizers (issue 16, item 1): torch's state, by torch's
names and dtypes, readable and writable, resident or paged out to disk; bitsandbytes' names
for the 8-bit optimizers; reading never moves pages."""

from __future__ import annotations

import copy

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdamW8bit
from tightfit.optim.lion import PagedLion8bit
from tightfit.optim.param_state import ParamState
from tightfit.optim.sgd import PagedSGD

PAGE = 4096
# resident: everything on the device tier; disk: a one-page budget puts every page in the
# spill file (a one-page streaming window is all the device holds)
BUDGETS = {"resident": {}, "disk": {"page_bytes": PAGE, "device_budget": PAGE}}
SHAPES = [(30, 40), (7,), (3000,)]  # 3000 elements span several 4 KiB pages

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _pair(torch_cls, paged_cls, budget: str, shapes=SHAPES, **kw):
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_(True) for p in ref]
    return ref, ours, torch_cls(ref, foreach=False, **kw), paged_cls(ours, **kw, **BUDGETS[budget])


def _steps(pairs, n: int, gen: torch.Generator) -> None:
    for _ in range(n):
        for r, o in zip(*(ps for ps, _ in pairs)):
            g = torch.randn(r.shape, generator=gen)
            r.grad, o.grad = g, g.clone()
        for _, opt in pairs:
            opt.step()


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize(("torch_cls", "paged_cls", "kw"), [
    (torch.optim.AdamW, PagedAdamW, {"amsgrad": True}),
    (torch.optim.Adam, PagedAdam, {}),
    (torch.optim.SGD, PagedSGD, {"lr": 0.01, "momentum": 0.9}),
])  # fmt: skip
def test_state_shows_torchs_names_dtypes_and_values(torch_cls, paged_cls, kw, budget) -> None:
    ref, ours, ref_opt, opt = _pair(torch_cls, paged_cls, budget, **kw)
    _steps([(ref, ref_opt), (ours, opt)], 4, torch.Generator().manual_seed(0))
    for r, o in zip(ref, ours):
        mine, theirs = opt.state[o], ref_opt.state[r]
        assert isinstance(mine, ParamState)
        assert set(theirs) <= set(mine)  # PagedSGD adds its step count to torch's buffer
        for name, value in theirs.items():
            if name == "step":
                assert float(mine["step"]) == float(value) == 4
                continue
            got = mine[name]
            assert got.shape == value.shape and got.dtype == value.dtype, name
            torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-7)
    opt.close()


def test_resident_state_is_a_view_of_its_page_live_as_torchs() -> None:
    ref, ours, ref_opt, opt = _pair(torch.optim.AdamW, PagedAdamW, "resident", [(30, 40)])
    gen = torch.Generator().manual_seed(1)
    _steps([(ref, ref_opt), (ours, opt)], 1, gen)
    held, held_ref = opt.state[ours[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"]
    before = opt.memory_stats()
    _steps([(ref, ref_opt), (ours, opt)], 3, gen)
    torch.testing.assert_close(held, held_ref, rtol=1e-6, atol=1e-7)  # follows every step
    assert opt.memory_stats()["bytes_paged_in"] == before["bytes_paged_in"] == 0
    opt.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_writes_land_in_the_pages(budget) -> None:
    ref, ours, ref_opt, opt = _pair(torch.optim.AdamW, PagedAdamW, budget)
    gen = torch.Generator().manual_seed(2)
    _steps([(ref, ref_opt), (ours, opt)], 2, gen)
    # the same edits on torch's state and ours: assignment, in-place on a temporary, and
    # in-place on a held tensor
    for r, o in zip(ref, ours):
        ref_opt.state[r]["exp_avg"] = torch.full_like(r, 0.25)
        opt.state[o]["exp_avg"] = torch.full_like(o, 0.25)
        ref_opt.state[r]["exp_avg_sq"].mul_(0.5)
        opt.state[o]["exp_avg_sq"].mul_(0.5)
    held = opt.state[ours[2]]["exp_avg"]
    held.add_(1.0)
    ref_opt.state[ref[2]]["exp_avg"].add_(1.0)
    _steps([(ref, ref_opt), (ours, opt)], 2, gen)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[o]["exp_avg"], ref_opt.state[r]["exp_avg"],
                                   rtol=1e-6, atol=1e-7)  # fmt: skip
    # a held copy follows the steps made since, as torch's tensor does
    torch.testing.assert_close(held, ref_opt.state[ref[2]]["exp_avg"], rtol=1e-6, atol=1e-7)
    opt.close()


def test_reading_paged_out_state_moves_no_page_and_keeps_the_budget() -> None:
    _, ours, _, opt = _pair(torch.optim.AdamW, PagedAdamW, "disk")
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step()
    before = opt.memory_stats()
    assert before["disk_bytes"] == before["state_bytes"]  # every page is in the spill file
    norms = [opt.state[p][name].norm() for p in ours for name in ("exp_avg", "exp_avg_sq")]
    after = opt.memory_stats()
    assert all(n > 0 for n in norms)
    for key in ("bytes_paged_in", "bytes_paged_out", "disk_bytes", "device_bytes",
                "peak_device_bytes", "page_faults"):  # fmt: skip
        assert after[key] == before[key], key
    opt.close()


def test_bad_writes_raise_and_change_nothing() -> None:
    p = torch.randn(10, 4)
    opt = PagedAdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    before = opt.state[p]["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"shape \(10, 4\).*pass a tensor shaped like the param"):
        opt.state[p]["exp_avg"] = torch.zeros(40)
    with pytest.raises(TypeError, match="must be a Tensor"):
        opt.state[p]["exp_avg"] = 0.0
    with pytest.raises(TypeError, match="cannot be removed"):
        del opt.state[p]["exp_avg"]
    assert torch.equal(opt.state[p]["exp_avg"], before)
    opt.close()


def test_state_mapping_survives_deepcopy_pickle_and_state_dicts() -> None:
    p = torch.randn(6, 3)
    opt = PagedAdamW([p], page_bytes=PAGE, device_budget=PAGE)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["note"] = "mine"  # any key, as in torch
    plain = copy.deepcopy(opt.state[p])
    assert type(plain) is dict and set(plain) == {"step", "note", "exp_avg", "exp_avg_sq"}
    assert torch.equal(plain["exp_avg"], opt.state[p]["exp_avg"])
    sd = opt.state_dict()
    assert sd["state"][0]["note"] == "mine"
    other = PagedAdamW([p.clone()])
    other.load_state_dict(sd)
    assert other.state[other.param_groups[0]["params"][0]]["note"] == "mine"
    for c in (opt, other):
        c.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_8bit_lion_state_reads_as_bitsandbytes_names(budget) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    ref = torch.randn(64, 130)
    ours = ref.clone()
    ref_opt = bnb.optim.Lion8bit([ref], lr=1e-4)
    kw = {"page_bytes": 8192, "device_budget": 8192} if budget == "disk" else {}
    opt = PagedLion8bit([ours], lr=1e-4, **kw)
    for _ in range(3):
        ref.grad = torch.randn(ref.shape)
        ours.grad = ref.grad.clone()
        ref_opt.step()
        opt.step()
    st, rst = opt.state[ours], ref_opt.state[ref]
    assert set(st) == {"step", "state1", "absmax1", "qmap1"}
    for name in ("state1", "absmax1", "qmap1"):
        assert torch.equal(st[name].reshape(-1), rst[name].reshape(-1)), name
    opt.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_8bit_state_reads_as_bitsandbytes_names(budget) -> None:
    """bitsandbytes' own 8-bit tests read state[p]["state1"], ["qmap1"], ["absmax1"] and
    dequantize them; the same reads give bitsandbytes' values here (bit for bit)."""
    bnb = pytest.importorskip("bitsandbytes")
    F = bnb.functional
    shapes = [(64, 130), (10,)]  # one 8-bit param (>= 4096 elements), one fp32-state param
    ref = [torch.randn(s) for s in shapes]
    ours = [p.clone() for p in ref]
    ref_opt = bnb.optim.AdamW8bit(ref, lr=1e-3)
    kw = {"page_bytes": 8192, "device_budget": 8192} if budget == "disk" else {}
    opt = PagedAdamW8bit(ours, lr=1e-3, **kw)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for r, o in zip(ref, ours):
            r.grad = torch.randn(r.shape, generator=gen)
            o.grad = r.grad.clone()
        ref_opt.step()
        opt.step()
    big, small = ours
    st, rst = opt.state[big], ref_opt.state[ref[0]]
    assert {"step", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"} <= set(st)
    for name in ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"):
        assert st[name].dtype == rst[name].dtype, name
        assert torch.equal(st[name].reshape(-1), rst[name].reshape(-1).to(st[name].device)), name
    dq = F.dequantize_blockwise(st["state1"], absmax=st["absmax1"], code=st["qmap1"],
                                blocksize=256)  # fmt: skip
    torch.testing.assert_close(dq, opt.torch_state_dict()["state"][0]["exp_avg"])
    assert set(opt.state[small]) == {"step", "state1", "state2"}  # fp32 state: no maps
    assert opt.state[small]["state1"].dtype == torch.float32
    with pytest.raises(ValueError, match="fixed quantization map"):
        opt.state[big]["qmap1"] = torch.zeros(256)
    # a write of codes lands in the page: zeroed codes dequantize to zero
    opt.state[big]["state1"] = torch.full_like(st["state1"], 127)  # signed map: code 127 = 0
    assert opt.torch_state_dict()["state"][0]["exp_avg"].abs().max() == 0
    opt.close()


def test_an_edited_copy_once_dropped_is_seen_by_the_next_read() -> None:
    p = torch.randn(3000)
    opt = PagedAdamW([p], page_bytes=PAGE, device_budget=PAGE)  # every page on disk
    p.grad = torch.randn_like(p)
    opt.step()
    before = opt.state[p]["exp_avg"].clone()
    opt.state[p]["exp_avg"].mul_(2.0)  # an in-place edit of a copy, dropped at once
    torch.testing.assert_close(opt.state[p]["exp_avg"], before * 2)
    torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"], before * 2)
    opt.close()
