"""PagedLion against a plain Lion written here; PagedLion8bit against bitsandbytes' Lion8bit."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from tightfit.optim import quant8
from tightfit.optim.lion import PagedLion, PagedLion8bit

PAGE = 16 << 10
SIZES = [1, 7, 4097, 30_011]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class PlainLion:
    """Lion as the paper writes it (Chen et al. 2023, Algorithm 2), one tensor at a time."""

    def __init__(self, groups: list[dict]) -> None:
        self.groups = groups
        self.m = {id(p): torch.zeros_like(p) for g in groups for p in g["params"]}

    @torch.no_grad()
    def step(self) -> None:
        for g in self.groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                m = self.m[id(p)]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                c = m * b1 + p.grad * (1 - b1)
                p.add_(torch.sign(c), alpha=-g["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def _groups(ps: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": [ps[0], ps[2]], "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.99)},
        {"params": [ps[1], ps[3]], "lr": 3e-4, "weight_decay": 0.0, "betas": (0.95, 0.98)},
    ]


@pytest.mark.parametrize("budget", ["unlimited", "one_page", "30%"])
def test_paged_lion_matches_plain_lion_over_50_steps(budget: str) -> None:
    ref = [torch.randn(n) for n in SIZES]
    ours = [p.clone() for p in ref]
    state_bytes = 4 * sum(SIZES)
    limit = {"unlimited": None, "one_page": PAGE, "30%": max(PAGE, int(0.3 * state_bytes))}[budget]
    opt = PagedLion(_groups(ours), page_bytes=PAGE, device_budget=limit)
    plain = PlainLion(_groups(ref))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for step in range(50):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
        sched.step()
        for pg, rg in zip(opt.param_groups, plain.groups):
            rg["lr"] = pg["lr"]
        assert step < 49 or all(_rel(a, b) <= 1e-6 for a, b in zip(ours, ref))
    if budget != "unlimited":
        assert opt.memory_stats()["peak_device_bytes"] <= limit
    sd = opt.state_dict()
    assert set(sd["state"][3]) == {"step", "exp_avg"}
    assert _rel(sd["state"][3]["exp_avg"], plain.m[id(ref[3])]) <= 1e-6
    opt.close()


@pytest.mark.parametrize("budget", [None, PAGE])
def test_lion8bit_bit_identical_to_bitsandbytes(budget: int | None) -> None:
    sizes = [20_000, 5000, 100]
    ref = [torch.randn(n) for n in sizes]
    ours = [p.clone() for p in ref]
    opt = PagedLion8bit(ours, lr=1e-3, weight_decay=0.1, page_bytes=PAGE, device_budget=budget)
    ref_opt = bnb.optim.Lion8bit(ref, lr=1e-3, weight_decay=0.1)
    for _ in range(8):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        if quant8.is_8bit(a.numel()):
            assert torch.equal(a, b)
        else:
            assert _rel(a, b) <= 1e-6
    stats = opt.memory_stats()
    assert stats["state_bytes"] / sum(sizes) < 1.3  # one code + an absmax per 256 (+ small fp32)
    opt.close()


def test_lion8bit_state_dict_round_trip_and_torch_format() -> None:
    ps = [torch.randn(n) for n in (9000, 50)]
    opt = PagedLion8bit(ps, lr=1e-3, page_bytes=PAGE)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    twin = [p.clone() for p in ps]
    opt2 = PagedLion8bit(twin, lr=1e-3, page_bytes=PAGE, device_budget=PAGE)
    opt2.load_state_dict(opt.state_dict())
    for _ in range(3):
        for a, b in zip(ps, twin):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, twin))
    tsd = opt.torch_state_dict()
    assert set(tsd["state"][0]) == {"step", "exp_avg"} and tsd["state"][0]["exp_avg"].dtype == torch.float32
    fresh = PagedLion8bit([p.clone() for p in ps], page_bytes=PAGE)
    fresh.load_state_dict(tsd)  # quantizes torch-format state back
    assert fresh.state_dict()["state"][0]["state1"].dtype == torch.uint8
    for o in (opt, opt2, fresh):
        o.close()


@pytest.mark.parametrize("cls", [PagedLion, PagedLion8bit])
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"betas": (1.0, 0.99)}, "Invalid beta parameter at index 0"),
    ({"betas": 0.9}, "must be a pair"),
    ({"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
    ({"page_bytes": 0}, "page_bytes"),
])
def test_bad_input(cls, kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        cls([torch.randn(5000)], **kwargs)


def test_lion8bit_torch_backend_close_to_bitsandbytes_kernel() -> None:
    base = torch.randn(20_000)
    out = {}
    for backend in ("torch", "bitsandbytes"):
        p = base.clone()
        opt = PagedLion8bit([p], lr=1e-3, weight_decay=0.1, page_bytes=PAGE, backend=backend)
        torch.manual_seed(3)
        for _ in range(5):
            p.grad = torch.randn_like(p)
            opt.step()
        out[backend] = p
        opt.close()
    # sign updates: an element differs only where a momentum code rounds across zero
    differ = (out["torch"] != out["bitsandbytes"]).float().mean().item()
    assert differ < 0.01
    assert _rel(out["torch"], out["bitsandbytes"]) < 1e-3


def test_bf16_params_fp32_momentum() -> None:
    p = torch.randn(3000, dtype=torch.bfloat16)
    ref = p.float()
    opt = PagedLion([p], lr=1e-2, page_bytes=PAGE)
    plain = PlainLion([{"params": [ref], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.9, 0.99)}])
    for _ in range(3):
        g = torch.randn(3000).bfloat16()
        p.grad, ref.grad = g, g.float()
        opt.step()
        plain.step()
        ref.copy_(ref.bfloat16().float())  # the param is rounded to bf16 after each step
    assert p.dtype == torch.bfloat16
    assert _rel(p.float(), ref) < 1e-2
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
    opt.close()
