"""An out-of-memory error part-way through step(): the step completes once, nothing repeats."""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW

from ..pressure.fakes import FakeProbe

PAGE = 16 << 10
SIZES = [3000, 5000, 4097, 9000]  # 168 KiB of state: 11 pages of at most 16 KiB


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to kernel rounding (1e-6 relative); an update applied twice or lost is ~1e-2."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-6


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


class FailOnce:
    """Wraps ``opt._update``: the ``at``-th call of step ``step`` raises OutOfMemoryError first.

    The error comes before the kernel touches anything, like an allocation failure in the
    kernel's setup (torch's fused Adam mutates state only inside its one kernel).
    """

    def __init__(self, opt: PagedAdamW, step: int, at: int) -> None:
        self.opt, self.step, self.at = opt, step, at
        self.inner = opt._update
        self.calls = 0
        self.fired = False
        self.pages_updated_before = 0
        opt._update = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if self.opt._step_id == self.step and not self.fired:
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                self.pages_updated_before = sum(
                    p.updated_step == self.step for p in self.opt.pager.pages
                )
                raise torch.OutOfMemoryError("fake: could not allocate 4.00 MiB")
        self.inner(*args, **kwargs)


@pytest.mark.parametrize(
    ("budget", "at"),
    [
        (None, 1),  # everything resident: fails in the one batched update, before any page
        (6 * PAGE, 2),  # resident batch done, fails on the first streamed page
        (6 * PAGE, 4),  # fails deeper into the streamed pages
    ],
)
def test_oom_mid_step_finishes_once_and_matches_torch(budget: int | None, at: int) -> None:
    ref = _params()
    ours = [p.clone() for p in ref]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt = PagedAdamW(ours, lr=1e-2, weight_decay=0.1, page_bytes=PAGE, device_budget=budget)
    fail = FailOnce(opt, step=3, at=at)
    for step in range(1, 7):
        for r, o, g in zip(ref, ours, _grads(step)):
            r.grad, o.grad = g, g.clone()
        ref_opt.step()
        opt.step()  # step 3 hits the fake OOM and recovers inside
    assert fail.fired
    if at > 1:
        assert fail.pages_updated_before > 0  # "part-way": some pages were already done
    for r, o in zip(ref, ours):
        assert _close(o, r)
    theirs = ref_opt.state_dict()["state"]
    mine = opt.state_dict()["state"]
    for i in range(len(SIZES)):
        assert float(mine[i]["step"]) == float(theirs[i]["step"]) == 6.0
        assert _close(mine[i]["exp_avg"], theirs[i]["exp_avg"])
        assert _close(mine[i]["exp_avg_sq"], theirs[i]["exp_avg_sq"])
    stats = opt.memory_stats()
    assert stats["oom_recoveries"] == 1
    oom = [e for e in opt.paging_events() if e.kind == "oom"]
    assert len(oom) == 1 and "fake: could not allocate" in oom[0].reason
    # the recovery drained the device down to the streaming window, and the log says so
    evicts = [e for e in opt.paging_events() if e.kind == "evict"]
    assert evicts and evicts[-1].reason.startswith("out of memory in step")
    assert stats["resident_bytes"] == 0 and stats["window_bytes"] <= 2 * PAGE
    opt.close()


def test_pages_come_back_after_an_oom_once_pressure_is_gone() -> None:
    ours = _params()
    used = {"other": 0}
    opt = PagedAdamW(ours, lr=1e-2, page_bytes=PAGE, target=1 << 20,
                     probe=FakeProbe(2 << 20, [lambda: used["other"]]))
    FailOnce(opt, step=2, at=1)
    for step in range(1, 5):
        for o, g in zip(ours, _grads(step)):
            o.grad = g
        opt.step()
        if step == 2:
            assert opt.memory_stats()["resident_bytes"] == 0  # streamed after the OOM
    stats = opt.memory_stats()
    assert stats["oom_recoveries"] == 1
    assert stats["resident_bytes"] == stats["state_bytes"]  # restored at step 3
    assert stats["restores"] >= 1
    kinds = [e.kind for e in opt.paging_events()]
    assert kinds.index("oom") < len(kinds) - 1 - kinds[::-1].index("restore")
    opt.close()


def test_a_second_oom_while_finishing_leaves_the_step_pending() -> None:
    ours = _params()
    opt = PagedAdamW(ours, lr=1e-2, page_bytes=PAGE)
    inner = opt._update

    def always_oom(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise torch.OutOfMemoryError("fake: still no room")

    for o, g in zip(ours, _grads(1)):
        o.grad = g
    opt._update = always_oom  # type: ignore[method-assign]
    with pytest.raises(torch.OutOfMemoryError, match="still no room"):
        opt.step()
    with pytest.raises(RuntimeError, match="finish_step"):
        opt.step()
    opt._update = inner  # type: ignore[method-assign]
    opt.finish_step()  # completes the interrupted step once
    ref = _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for r, g in zip(ref, _grads(1)):
        r.grad = g
    ref_opt.step()
    for r, o in zip(ref, ours):
        assert _close(o, r)
    opt.close()


@pytest.mark.parametrize("slabs", [None, False], ids=["slabs", "page-buffers"])
def test_oom_after_one_layout_of_a_batch_does_not_repeat_it(monkeypatch, slabs) -> None:
    # fp32 and bf16 params in one group (two layouts) and a second group: the resident batch
    # takes one kernel call per layout; the error hits the second call, after the first
    # layout's pages were updated. Before the fix those pages were not yet marked, and the
    # recovery updated them a second time.
    monkeypatch.setattr(PagedAdamW, "_slabs", slabs)
    gen = torch.Generator().manual_seed(5)
    f32 = [torch.randn(n, generator=gen) for n in (3000, 7000)]
    b16 = [torch.randn(5000, generator=gen).bfloat16()]
    extra = [torch.randn(4000, generator=gen)]
    ours = [*f32, *b16, *extra]
    ref = [p.float().clone() for p in ours]
    opt = PagedAdamW([{"params": [f32[0], b16[0], f32[1]]}, {"params": extra, "lr": 5e-3}],
                     lr=1e-2, page_bytes=PAGE)
    ref_opt = torch.optim.AdamW([{"params": [ref[0], ref[2], ref[1]]},
                                 {"params": [ref[3]], "lr": 5e-3}], lr=1e-2, foreach=False)
    fail = FailOnce(opt, step=2, at=2)
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(50 + step)
        for r, o in zip(ref, ours):
            g = torch.randn(o.shape, generator=gen).to(o.dtype)
            o.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        ref[2].data.copy_(ours[2].float())  # bf16 rounds: follow it, compare the fp32 params
    assert fail.fired and fail.pages_updated_before > 0
    for i in (0, 1, 3):
        assert _close(ours[i], ref[i]), i
    opt.close()
