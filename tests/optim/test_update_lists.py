"""The update's lists cached across steps: reused when nothing changed, rebuilt when it did."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim import update_lists
from tightfit.optim.adamw import PagedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAGE = 64 << 10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _count_builds(monkeypatch) -> list[int]:
    calls: list[int] = []
    build = update_lists.coalesce

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(update_lists, "coalesce", counted)
    return calls


@pytest.mark.parametrize("slabs", [None, False], ids=["slabs", "page-buffers"])
def test_cached_lists_follow_every_change_and_match_torch(monkeypatch, slabs) -> None:
    monkeypatch.setattr(PagedAdamW, "_slabs", slabs)
    builds = _count_builds(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    sizes = [30_000, 7, 20_000, 64]
    ours = [torch.randn(n, generator=gen) for n in sizes]
    ref = [p.clone() for p in ours]
    opt = PagedAdamW(ours, page_bytes=PAGE)
    ref_opt = torch.optim.AdamW(ref, foreach=False)

    def step(k: int, skip: int | None = None) -> None:
        g = torch.Generator().manual_seed(100 + k)
        for i, (o, r) in enumerate(zip(ours, ref)):
            grad = torch.randn(o.shape, generator=g)
            o.grad, r.grad = (None, None) if i == skip else (grad, grad.clone())
        opt.step()
        ref_opt.step()

    step(0)
    step(1)
    assert len(builds) == 1  # the second step reused the lists
    step(2, skip=1)  # a param without a grad: other lists
    step(3)
    assert len(builds) == 2  # ... and back to the cached ones once it has a grad again
    new = ours[2].detach().clone()  # the param's storage replaced under the optimizer
    ours[2].data = new
    step(4)
    assert len(builds) == 3
    opt.pager.limit_device(2 * PAGE + PAGE // 2, "test")  # pages move: nothing cached survives
    assert opt._view_cache == {}
    step(5)
    opt.pager.restore_bytes(None, "test")
    step(6)
    assert opt._view_cache
    sd = opt.state_dict()
    opt.load_state_dict(sd)  # new step tensors: the cache must not keep the old ones
    assert opt._view_cache == {}
    step(7)
    step(8)
    for o, r in zip(ours, ref):
        assert _rel(o, r) <= 1e-6
    assert float(opt.state_dict()["state"][0]["step"]) == 9.0
    opt.close()
    assert opt._view_cache == {}


def test_streamed_pages_are_never_cached() -> None:
    ours = [torch.randn(60_000)]
    opt = PagedAdamW(ours, page_bytes=PAGE, device_budget=3 * PAGE)
    for _ in range(2):
        ours[0].grad = torch.randn_like(ours[0])
        opt.step()
    streamed = {p.index for p in opt.pager.pages if p.tier != "device"}
    assert streamed
    cached_ids = {i for key in opt._view_cache for i in key[0]}
    # only the arrays of resident pages are keys; a window slot's views change every step
    resident_ids = {id(opt.pager.arrays(p)) for p in opt.pager.pages if p.tier == "device"}
    assert cached_ids <= resident_ids
    opt.close()
