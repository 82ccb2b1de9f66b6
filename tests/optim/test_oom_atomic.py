"""The non-fused Adam paths (foreach, single tensor), PagedLion and PagedSGD (every path) keep
the sweep's rule "an update that raised changed nothing": an out-of-memory error at any
allocation inside the update leaves params and state as they were, so the retry applies the update once.

torch's own foreach/single-tensor Adam scales the params and updates the moments in place
before it allocates the denominator (``_foreach_sqrt``, ``exp_avg_sq.sqrt()``); an error
there, retried, applied the decay and the moment update twice (params ~1e-2 away from torch's
AdamW after 3 steps). The faults here are real allocation points: the k-th op of the step
that makes a new param-sized storage raises instead (what the caching allocator would do).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tightfit.optim import adam_math
from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.lion import PagedLion
from tightfit.optim.sgd import PagedSGD

PAGE = 16 << 10
SIZES = [3000, 5000, 4097]
BIG = 512  # elements: a param-sized temporary, not a step count or a scalar

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to kernel rounding (1e-6 relative); an update applied twice is ~1e-2."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-6


class AllocationFault(TorchDispatchMode):
    """Raises ``torch.OutOfMemoryError`` at the ``at``-th op (from 1) whose output is a new
    storage of at least ``BIG`` elements, the ``times`` first times that point is reached
    (in-place ops and views allocate nothing and are not counted). Records the op's name."""

    def __init__(self, at: int, times: int = 1) -> None:
        super().__init__()
        self.at, self.left, self.count = at, times, 0
        self.fired: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.left > 0:
            inputs = {t.untyped_storage().data_ptr()
                      for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                   and t.numel() >= BIG and t.untyped_storage().data_ptr() not in inputs]
            if new:
                self.count += 1
                if self.count == self.at:
                    self.left -= 1
                    self.count = 0  # the retry counts afresh
                    self.fired.append(str(func))
                    raise torch.OutOfMemoryError(f"fake: out of memory in {func}")
        return out


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(11)
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


KERNELS = {"foreach": {"foreach": True}, "foreach-ops": {"foreach": True},
           "forloop": {"foreach": False}}  # fmt: skip


@pytest.fixture(autouse=True)
def _foreach_ops(request, monkeypatch) -> None:
    """``foreach-ops``: the foreach arrangement CUDA runs (on the CPU ``foreach=True`` runs
    the loop, torch's foreach being a loop there)."""
    kernel = getattr(request.node, "callspec", None)
    if kernel is not None and kernel.params.get("kernel") == "foreach-ops":
        monkeypatch.setattr(adam_math, "LOOP_ON_CPU", False)
VARIANTS = {
    "adamw": (PagedAdamW, torch.optim.AdamW, {"weight_decay": 0.1}),
    "adamw-amsgrad-maximize": (PagedAdamW, torch.optim.AdamW,
                               {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    "adam-l2": (PagedAdam, torch.optim.Adam, {"weight_decay": 0.1}),
}


def _run(cls: type, kw: dict[str, Any], budget: int | None, fault_step: int, at: int,
         times: int = 1) -> tuple[list[nn.Parameter], Any, AllocationFault]:
    ours = _params()
    opt = cls(ours, lr=1e-2, page_bytes=PAGE, device_budget=budget, **kw)
    fault = AllocationFault(at, times)
    for step in range(1, 4):
        for p, g in zip(ours, _grads(step)):
            p.grad = g
        if step == fault_step:
            with fault:
                opt.step()
        else:
            opt.step()
    return ours, opt, fault


def _reference(torch_cls: type, kw: dict[str, Any]) -> tuple[list[nn.Parameter], Any]:
    ref = _params()
    opt = torch_cls(ref, lr=1e-2, foreach=False, **kw)
    for step in range(1, 4):
        for p, g in zip(ref, _grads(step)):
            p.grad = g
        opt.step()
    return ref, opt


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("at", [1, 2, 3])
@pytest.mark.parametrize("budget", [None, 2 * PAGE], ids=["resident", "streamed"])
def test_an_oom_at_an_allocation_in_the_update_is_retried_exactly(kernel, variant, at,
                                                                   budget) -> None:
    cls, torch_cls, kw = VARIANTS[variant]
    ours, opt, fault = _run(cls, {**kw, **KERNELS[kernel]}, budget, fault_step=2, at=at)
    ref, ref_opt = _reference(torch_cls, kw)
    if at == 1:
        assert fault.fired  # every path allocates at least once per update
    assert opt.memory_stats()["oom_recoveries"] == len(fault.fired)
    for o, r in zip(ours, ref):
        assert _close(o.detach(), r.detach())
    mine, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for i in range(len(SIZES)):
        assert float(mine[i]["step"]) == float(theirs[i]["step"]) == 3.0
        for name in theirs[i]:
            if name != "step":
                assert _close(mine[i][name], theirs[i][name]), name
    opt.close()


def test_the_fault_hits_where_torch_allocated_after_writing(monkeypatch) -> None:
    # The point the review found (torch's foreach Adam: _foreach_sqrt after the in-place decay
    # and moment updates) is the first param-sized allocation of a decoupled AdamW step; here
    # that allocation now comes before any write.
    monkeypatch.setattr(adam_math, "LOOP_ON_CPU", False)
    ours, opt, fault = _run(PagedAdamW, {"weight_decay": 0.1, "foreach": True}, None, 2, at=1)
    assert len(fault.fired) == 1
    ref, _ = _reference(torch.optim.AdamW, {"weight_decay": 0.1})
    assert all(_close(o.detach(), r.detach()) for o, r in zip(ours, ref))
    opt.close()


@pytest.mark.parametrize("kernel", KERNELS)
def test_finish_step_after_an_oom_escaped_step(kernel) -> None:
    # The retry fails too: the error leaves step() and the step stays pending. finish_step()
    # then writes the leaf params in place (views made under step()'s no_grad): it runs under
    # no_grad too (before: "a view was created in no_grad mode and is being modified inplace").
    kw = {"weight_decay": 0.1, **KERNELS[kernel]}
    ours = _params()
    opt = PagedAdamW(ours, lr=1e-2, page_bytes=PAGE, **kw)
    for step in range(1, 4):
        for p, g in zip(ours, _grads(step)):
            p.grad = g
        if step == 2:
            fault = AllocationFault(at=1, times=2)
            with fault, pytest.raises(torch.OutOfMemoryError, match="fake: out of memory"):
                opt.step()
            assert len(fault.fired) == 2
            opt.finish_step()
        else:
            opt.step()
    ref, _ = _reference(torch.optim.AdamW, {"weight_decay": 0.1})
    for o, r in zip(ours, ref):
        assert _close(o.detach(), r.detach())
    opt.close()


@pytest.mark.parametrize("arrangement", ["foreach-ops", "loop"])
@pytest.mark.parametrize("foreach", [True, False], ids=["torch-foreach", "torch-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_reordered_math_is_torchs_bit_for_bit(arrangement, foreach, dtype) -> None:
    # adam_math against torch.optim.adam's foreach and single-tensor functions, every flag
    # that changes the ops: the same values, bit for bit, over 4 steps (on the CPU)
    from itertools import product

    from torch.optim.adam import adam

    run = adam_math._foreach if arrangement == "foreach-ops" else adam_math._loop
    for amsgrad, maximize, decoupled, wd in product([False, True], [False, True],
                                                    [True, False], [0.0, 0.1]):
        gen = torch.Generator().manual_seed(5)
        theirs = [torch.randn(n, generator=gen, dtype=dtype) for n in (7, 300, 1025)]
        ours = [p.clone() for p in theirs]
        ts, os_ = ([[torch.zeros_like(p) for p in theirs] for _ in range(2 + amsgrad)]
                   for _ in range(2))
        if not amsgrad:
            ts, os_ = [*ts, []], [*os_, []]
        for step in range(1, 5):
            grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in theirs]
            adam(theirs, grads, *ts, [torch.tensor(step - 1.0) for _ in theirs],
                 foreach=foreach, fused=False, decoupled_weight_decay=decoupled,
                 amsgrad=amsgrad, beta1=0.9, beta2=0.99, lr=1e-2, weight_decay=wd, eps=1e-8,
                 maximize=maximize)
            kept = [g.clone() for g in grads]
            run(ours, grads, *os_, [float(step)] * len(ours), amsgrad=amsgrad, beta1=0.9,
                beta2=0.99, lr=1e-2, weight_decay=wd, eps=1e-8, maximize=maximize,
                decoupled=decoupled)
            assert all(torch.equal(g, k) for g, k in zip(grads, kept))  # grads left alone
        for a, b in zip([*theirs, *ts[0], *ts[1], *ts[2]], [*ours, *os_[0], *os_[1], *os_[2]]):
            assert torch.equal(a, b), (amsgrad, maximize, decoupled, wd)


# ---------------------------------------------------------------- PagedLion and PagedSGD
# torch's single-tensor SGD allocates per tensor after updating the ones before it, its foreach
# Nesterov adds the buffers into p.grad in place, and PagedLion's foreach path decayed the
# params before allocating the direction (its loop allocated per tensor): each left a failed
# update half applied, and the retry applied it again.

OTHERS = {
    "lion": (PagedLion, None, {"weight_decay": 0.1}),
    "sgd-momentum": (PagedSGD, torch.optim.SGD, {"momentum": 0.9}),
    "sgd-nesterov-wd": (PagedSGD, torch.optim.SGD,
                        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    "sgd-dampening-maximize-wd": (PagedSGD, torch.optim.SGD,
                                  {"momentum": 0.9, "dampening": 0.5, "maximize": True,
                                   "weight_decay": 0.1}),
    "sgd-plain-wd": (PagedSGD, torch.optim.SGD, {"weight_decay": 0.1}),  # no state, no pages
}
OTHER_KERNELS = {"foreach": {"foreach": True}, "forloop": {"foreach": False},
                 "fused": {"fused": True}}  # fmt: skip


def _clean(cls: type, torch_cls: type | None, kw: dict[str, Any]) -> list[nn.Parameter]:
    """torch's optimizer (single-tensor loop) where there is one, else ours with no fault."""
    ref = _params()
    opt = (torch_cls(ref, lr=1e-2, foreach=False, **kw) if torch_cls is not None
           else cls(ref, lr=1e-2, page_bytes=PAGE, **kw))  # fmt: skip
    for step in range(1, 4):
        for p, g in zip(ref, _grads(step)):
            p.grad = g
        opt.step()
    return ref


@pytest.mark.parametrize("kernel", OTHER_KERNELS)
@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("at", [1, 2, 3])
@pytest.mark.parametrize("budget", [None, 2 * PAGE], ids=["resident", "streamed"])
@pytest.mark.parametrize("fault_step", [1, 2])
def test_lion_and_sgd_retry_an_oom_at_any_allocation_exactly(kernel, variant, at, budget,
                                                             fault_step) -> None:
    cls, torch_cls, kw = OTHERS[variant]
    if kernel == "fused" and cls is PagedLion:
        pytest.skip("there is no fused Lion kernel (fused=True raises)")
    ours = _params()
    opt = cls(ours, lr=1e-2, page_bytes=PAGE, device_budget=budget, **kw, **OTHER_KERNELS[kernel])
    opt.pager.materialize()  # the pages' own allocation is not the update's (not retried)
    fault = AllocationFault(at)
    for step in range(1, 4):
        for p, g in zip(ours, _grads(step)):
            p.grad = g
        with fault if step == fault_step else contextlib.nullcontext():
            opt.step()
    if at == 1 and kernel != "fused" and variant != "sgd-momentum":
        assert fault.fired  # these paths allocate in every update
    assert opt.memory_stats()["oom_recoveries"] == len(fault.fired)
    for o, r in zip(ours, _clean(cls, torch_cls, kw)):
        assert _close(o.detach(), r.detach())
    opt.close()


def test_sgd_leaves_the_callers_grads_alone_with_nesterov() -> None:
    # torch's foreach Nesterov adds the buffers into p.grad; a retry would then start from
    # changed gradients
    ours = _params()
    opt = PagedSGD(ours, lr=1e-2, momentum=0.9, nesterov=True, foreach=True, page_bytes=PAGE)
    for step in range(1, 3):
        grads = _grads(step)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))
    opt.close()


def test_an_oom_in_a_later_plain_sgd_group_does_not_repeat_the_earlier_groups() -> None:
    ref = _params()
    ref_opt = torch.optim.SGD([{"params": ref[:1], "weight_decay": 0.1},
                               {"params": ref[1:2], "momentum": 0.9},
                               {"params": ref[2:], "weight_decay": 0.2}], lr=1e-2, foreach=False)
    ours = _params()
    opt = PagedSGD([{"params": ours[:1], "weight_decay": 0.1},
                    {"params": ours[1:2], "momentum": 0.9},
                    {"params": ours[2:], "weight_decay": 0.2}], lr=1e-2, foreach=False,
                   page_bytes=PAGE)
    for step in range(1, 4):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.grad, q.grad = g, g.clone()
        if step == 2:
            with AllocationFault(at=2) as fault:  # the third group's weight-decay copy
                opt.step()
            assert len(fault.fired) == 1
        else:
            opt.step()
        ref_opt.step()
    assert opt.memory_stats()["oom_recoveries"] == 1
    for o, r in zip(ours, ref):
        assert _close(o.detach(), r.detach())
    opt.close()
