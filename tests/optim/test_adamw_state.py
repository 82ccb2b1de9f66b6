"""PagedAdamW state in and out: torch-format state dicts both ways, page files, mid-step failure."""

from __future__ import annotations

import os

import pytest
import torch

from tightfit.optim.adamw import PagedAdam, PagedAdamW

SIZES = [3, 5000, 20_001]
PAGE = 16 << 10


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _params() -> list[torch.Tensor]:
    torch.manual_seed(7)
    return [torch.randn(n) for n in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _run(opt, params, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()


def _paged(params, **kw):
    kw.setdefault("page_bytes", PAGE)
    kw.setdefault("device_budget", 3 * PAGE)
    return PagedAdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw)


def test_state_dict_round_trip_mid_run_is_bit_identical() -> None:
    a = _params()
    opt_a = _paged(a)
    _run(opt_a, a, range(10))
    sd = opt_a.state_dict()
    _run(opt_a, a, range(10, 20))
    # a fresh optimizer with other budgets: loading keeps ITS paging
    b_params = _snapshot_after(10)  # the params as they were when the state dict was taken
    opt_b = _paged(b_params, device_budget=PAGE)
    opt_b.load_state_dict(sd)
    assert opt_b.memory_stats()["device_budget"] == PAGE and opt_b.memory_stats()["disk_bytes"] > 0
    _run(opt_b, b_params, range(10, 20))
    for x, y in zip(a, b_params):
        assert torch.equal(x, y)
    opt_a.close()
    opt_b.close()


def _snapshot_after(n: int) -> list[torch.Tensor]:
    params = _params()
    opt = _paged(params)
    _run(opt, params, range(n))
    opt.close()
    return params


@pytest.mark.parametrize(("paged_cls", "torch_cls"), [(PagedAdamW, torch.optim.AdamW),
                                                      (PagedAdam, torch.optim.Adam)])
def test_torch_to_paged_and_back(paged_cls, torch_cls) -> None:
    ref = _params()
    ref_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)
    _run(ref_opt, ref, range(5))
    ours = [p.clone() for p in ref]
    opt = paged_cls(ours, lr=0.5, amsgrad=True, page_bytes=PAGE, device_budget=2 * PAGE)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2  # hyperparameters come from the state dict
    _run(ref_opt, ref, range(5, 10))
    _run(opt, ours, range(5, 10))
    for r, o in zip(ref, ours):
        assert ((o - r).norm() / r.norm()).item() <= 1e-6
    # and back: the paged state dict loads into torch's optimizer and continues identically
    back = [p.clone() for p in ours]
    back_opt = torch_cls(back, lr=0.5, amsgrad=True, foreach=False)
    back_opt.load_state_dict(opt.state_dict())
    assert back_opt.param_groups[0]["decoupled_weight_decay"] == (torch_cls is torch.optim.AdamW)
    _run(back_opt, back, range(10, 15))
    _run(opt, ours, range(10, 15))
    for b, o in zip(back, ours):
        assert ((o - b).norm() / b.norm()).item() <= 1e-6
    opt.close()


def test_save_load_streams_pages_and_is_atomic(tmp_path) -> None:
    a = _params()
    opt = _paged(a, spill_dir=tmp_path / "spill")
    _run(opt, a, range(4))
    path = tmp_path / "opt.pages"
    opt.save(path)
    assert path.stat().st_size > opt.memory_stats()["state_bytes"]
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".tightfit-save")] == []
    b = [p.clone() for p in a]
    opt2 = _paged(b, device_budget=None)
    opt2.load(path)
    _run(opt, a, range(4, 8))
    _run(opt2, b, range(4, 8))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    # another layout: refused before anything changes
    other = PagedAdamW([torch.randn(10)], page_bytes=PAGE)
    with pytest.raises(ValueError, match="another param shapes"):
        other.load(path)
    assert other.state_dict()["state"] == {}
    # a failed save leaves the old file intact and no temp file behind
    before = path.read_bytes()
    read_page = opt.pager.read_page

    def failing_read(page):  # an I/O error on the last page
        if page is opt.pager.pages[-1]:
            raise OSError("simulated read error")
        return read_page(page)

    opt.pager.read_page = failing_read
    with pytest.raises(OSError, match="simulated"):
        opt.save(path)
    opt.pager.read_page = read_page
    assert path.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".tightfit-save")] == []
    for o in (opt, opt2, other):
        o.close()


def test_state_dict_for_another_layout_is_refused_before_changes() -> None:
    a = _params()
    opt = _paged(a)
    _run(opt, a, range(2))
    before = opt.state_dict()
    wrong_shape = _paged([torch.randn(3), torch.randn(5000), torch.randn(20_000)]).state_dict()
    bad = torch.optim.AdamW([torch.randn(3), torch.randn(5000), torch.randn(20_000)])
    with pytest.raises(ValueError, match="another parameter layout"):
        x = [torch.randn(3), torch.randn(5000), torch.randn(20_000)]
        src = torch.optim.AdamW(x, amsgrad=True)
        for p in x:
            p.grad = torch.ones_like(p)
        src.step()
        opt.load_state_dict(src.state_dict())
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="has 3 params"):
        opt.load_state_dict(torch.optim.AdamW([torch.randn(3)]).state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(torch.optim.AdamW(_params(), amsgrad=False).state_dict())
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"exp_avg": 1})
    after = opt.state_dict()
    for i in before["state"]:
        for k in before["state"][i]:
            assert torch.equal(before["state"][i][k], after["state"][i][k])
    del wrong_shape, bad
    opt.close()


class _FailingOnce(PagedAdamW):
    """Raises in the update of the third page of the first step (e.g. a failing copy)."""

    calls = 0

    def _update_pages(self, items):
        type(self).calls += 1
        if type(self).calls == 3:
            raise OSError("simulated failure mid-step")
        super()._update_pages(items)


def test_failed_step_finishes_without_applying_twice() -> None:
    ref, ours = _params(), _params()
    ref_opt = _paged(ref)
    opt = _FailingOnce(ours, lr=1e-2, weight_decay=0.1, amsgrad=True, page_bytes=PAGE,
                       device_budget=3 * PAGE)
    for p, g in zip(ours, _grads(0)):
        p.grad = g
    with pytest.raises(OSError, match="simulated"):
        opt.step()
    with pytest.raises(RuntimeError, match="finish_step"):
        opt.step()
    opt.finish_step()
    _run(opt, ours, range(1, 4))
    _run(ref_opt, ref, range(4))
    for r, o in zip(ref, ours):
        assert torch.equal(r, o)
    assert all(opt.state[p]["step"].item() == 4 for p in ours)
    opt.close()
    ref_opt.close()


def test_close_frees_pages_and_deletes_spill_files(tmp_path) -> None:
    a = _params()
    with _paged(a, spill_dir=tmp_path) as opt:
        _run(opt, a, range(2))
        folder = opt.memory_stats()["spill_dir"]
        assert folder is not None and os.listdir(folder)
        assert os.path.dirname(folder) == str(tmp_path)
    assert not os.path.exists(folder)
    assert tmp_path.exists()  # the user's folder stays
    assert opt.memory_stats()["device_bytes"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # idempotent


def test_decoupled_weight_decay_follows_torch_when_loading_across_types() -> None:
    """torch.optim.Adam state into PagedAdamW decouples (as torch.optim.AdamW does); AdamW
    state into PagedAdam keeps decoupled decay (as torch.optim.Adam does)."""
    for src_cls, dst_cls, ref_cls in ((torch.optim.Adam, PagedAdamW, torch.optim.AdamW),
                                      (torch.optim.AdamW, PagedAdam, torch.optim.Adam)):
        p0 = torch.randn(500)
        src = src_cls([p0.clone()], lr=1e-2, weight_decay=0.1)
        ref_p, ours = p0.clone(), p0.clone()
        ref = ref_cls([ref_p], lr=1e-2, weight_decay=0.1, foreach=False)
        ref.load_state_dict(src.state_dict())
        opt = dst_cls([ours], lr=1e-2, weight_decay=0.1)
        opt.load_state_dict(src.state_dict())
        assert opt.param_groups[0]["decoupled_weight_decay"] == \
            ref.param_groups[0]["decoupled_weight_decay"]
        for _ in range(3):
            ref_p.grad = torch.randn(500)
            ours.grad = ref_p.grad.clone()
            ref.step()
            opt.step()
        assert ((ours - ref_p).norm() / ref_p.norm()).item() <= 1e-6
        opt.close()
