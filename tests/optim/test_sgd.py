"""PagedSGD against torch.optim.SGD: momentum, dampening, Nesterov, weight decay, budgets."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.sgd import PagedSGD

PAGE = 16 << 10
SIZES = [1, 7, 4097, 30_011]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _groups(ps: list[torch.Tensor], second: dict) -> list[dict]:
    return [
        {"params": [ps[0], ps[2]], "lr": 1e-2, "momentum": 0.9, "nesterov": True,
         "weight_decay": 0.01},
        {"params": [ps[1], ps[3]], "lr": 5e-3, **second},
    ]


SECOND = {
    "dampening": {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
    "no_momentum": {"momentum": 0.0, "weight_decay": 0.1},
    "maximize": {"momentum": 0.5, "maximize": True},
}


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%"])
@pytest.mark.parametrize("second", list(SECOND))
def test_matches_torch_sgd_over_50_steps(budget: str, second: str) -> None:
    ref = [torch.randn(n) for n in SIZES]
    ours = [p.clone() for p in ref]
    limit = {"unlimited": None, "one_page": PAGE, "30%": max(PAGE, int(0.3 * 4 * sum(SIZES)))}
    opt = PagedSGD(_groups(ours, SECOND[second]), page_bytes=PAGE, device_budget=limit[budget])
    ref_opt = torch.optim.SGD(_groups(ref, SECOND[second]), foreach=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 10, 0.5) for o in (opt, ref_opt)]
    for step in range(50):
        for i, (a, b) in enumerate(zip(ours, ref)):
            if step == 3 and i == 3:
                a.grad = b.grad = None  # a param without a gradient this step is skipped
                continue
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(ours, ref))
    if limit[budget] is not None:
        assert opt.memory_stats()["peak_device_bytes"] <= limit[budget]
    # torch's format: momentum buffers match torch's
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    for i, entry in rsd["state"].items():
        buf = entry.get("momentum_buffer")
        if buf is not None:
            assert _rel(sd["state"][i]["momentum_buffer"], buf) <= 1e-6
    opt.close()


def test_state_dicts_both_ways_mid_run() -> None:
    ref = [torch.randn(n) for n in SIZES]
    ours = [p.clone() for p in ref]
    groups = lambda ps: _groups(ps, SECOND["dampening"])  # noqa: E731
    ref_opt = torch.optim.SGD(groups(ref), foreach=False)
    for _ in range(3):
        for p in ref:
            p.grad = torch.randn_like(p)
        ref_opt.step()
    for a, b in zip(ours, ref):
        a.data.copy_(b)
    opt = PagedSGD(groups(ours), page_bytes=PAGE, device_budget=2 * PAGE)
    opt.load_state_dict(ref_opt.state_dict())  # torch -> paged (no "step" in torch's entries)
    for _ in range(5):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(ours, ref))
    back = torch.optim.SGD(groups([p.clone() for p in ref]), foreach=False)
    back.load_state_dict(opt.state_dict())  # paged -> torch
    assert _rel(back.state_dict()["state"][3]["momentum_buffer"],
                ref_opt.state_dict()["state"][3]["momentum_buffer"]) <= 1e-6
    opt.close()


def test_no_momentum_means_no_state_pages(tmp_path) -> None:
    p = torch.randn(10_000)
    opt = PagedSGD([p], lr=0.1, page_bytes=PAGE, spill_dir=tmp_path)
    p.grad = torch.ones_like(p)
    before = p.clone()
    opt.step()
    assert torch.allclose(p, before - 0.1)
    assert opt.memory_stats()["state_bytes"] == 0 and opt.memory_stats()["pages"] == 0
    opt.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"momentum": -0.5}, "Invalid momentum value: -0.5"),
    ({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
    ({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
    ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "and dampening=0"),
    ({"device_budget": -5}, "negative"),
])
def test_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PagedSGD([torch.randn(5000)], page_bytes=PAGE, **kwargs)


def test_sparse_gradients_rejected() -> None:
    p = torch.randn(100)
    opt = PagedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(100).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    opt.close()


@pytest.mark.parametrize("arrangement", ["foreach", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_reordered_math_is_torchs_bit_for_bit(arrangement: str, dtype: torch.dtype) -> None:
    # sgd_math against torch.optim.sgd's own foreach / single-tensor function, every flag that
    # changes the ops, torch's None buffers on the first step (ours: zeros marked first)
    from itertools import product

    from torch.optim.sgd import sgd

    from tightfit.optim import sgd_math

    for momentum, dampening, nesterov, maximize, wd in product(
            [0.0, 0.9], [0.0, 0.5], [False, True], [False, True], [0.0, 0.1]):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        gen = torch.Generator().manual_seed(9)
        theirs = [torch.randn(n, generator=gen, dtype=dtype) for n in (7, 300, 1025)]
        ours = [p.clone() for p in theirs]
        tbufs: list = [None] * len(theirs)
        obufs = [torch.zeros_like(p) for p in ours]
        for step in range(1, 5):
            grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in theirs]
            hp = {"weight_decay": wd, "momentum": momentum, "lr": 1e-2, "dampening": dampening,
                  "nesterov": nesterov, "maximize": maximize}
            sgd(theirs, [g.clone() for g in grads], tbufs, foreach=arrangement == "foreach", **hp)
            kept = [g.clone() for g in grads]
            sgd_math.sgd_(ours, grads, obufs, [step == 1] * len(ours),
                          foreach=arrangement == "foreach", **hp)
            assert all(torch.equal(g, k) for g, k in zip(grads, kept))  # grads left alone
        flags = (momentum, dampening, nesterov, maximize, wd)
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours)), flags
        if momentum:
            assert all(torch.equal(a, b) for a, b in zip(tbufs, obufs)), flags
