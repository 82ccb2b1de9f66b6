"""An out-of-memory error in step(): what the failed attempt allocated is freed before the
drain and the retry (the retry runs outside the ``except`` that caught the error), and a
second error is one clear error, not one raised while handling the first."""

from __future__ import annotations

import weakref

import pytest
import torch

from tightfit.optim import base
from tightfit.optim.adamw import PagedAdamW

from .test_oom_recovery import FailOnce

PAGE = 16 << 10
SIZES = [3000, 5000, 4097]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=gen).bfloat16() for n in SIZES]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(200 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()


class KernelOOM:
    """torch's fused AdamW kernel raising ``torch.OutOfMemoryError`` on its first ``times``
    calls of step ``step``, as an allocation inside the update would. Keeps weakrefs to the
    tensors the failed calls were given: for bf16 params the fp32 copies of params and grads
    that the update made (``base._update_pages``), alive only as long as its frame is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, opt: PagedAdamW, step: int,
                 times: int = 1) -> None:
        self.opt, self.step, self.left = opt, step, times
        self.refs: list[weakref.ref] = []
        self.alive_at_retry: list[int] = []
        self.alive_at_drain: list[int] = []
        self.real = torch._fused_adamw_
        monkeypatch.setattr(torch, "_fused_adamw_", self)
        real_recover = base.recover_from_oom

        def recover(store, why):  # noqa: ANN001, ANN202
            self.alive_at_drain.append(self.alive())
            return real_recover(store, why)

        monkeypatch.setattr(base, "recover_from_oom", recover)

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def __call__(self, params, grads, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        if self.opt._step_id == self.step:
            if self.refs:
                self.alive_at_retry.append(self.alive())
            if self.left > 0:
                self.left -= 1
                self.refs += [weakref.ref(t) for t in (*params, *grads)]
                raise torch.OutOfMemoryError("fake: could not allocate 6.00 MiB")
        self.real(params, grads, *args, **kwargs)


def _clean_run(steps: int) -> list[torch.Tensor]:
    ref = _params()
    opt = PagedAdamW(ref, lr=1e-2, weight_decay=0.1, page_bytes=PAGE)
    for step in range(1, steps + 1):
        _set_grads(ref, step)
        opt.step()
    opt.close()
    return ref


def test_the_failed_attempts_tensors_are_freed_before_the_drain_and_retry(monkeypatch) -> None:
    ours = _params()
    opt = PagedAdamW(ours, lr=1e-2, weight_decay=0.1, page_bytes=PAGE)
    fault = KernelOOM(monkeypatch, opt, step=2)
    for step in range(1, 5):
        _set_grads(ours, step)
        opt.step()  # step 2 runs out of memory in the kernel and finishes by streaming
    # the fp32 copies of params and grads of the run of pages that failed (views of one scratch)
    assert len(fault.refs) >= 2
    # before: the traceback of the first error held all of them through both
    assert fault.alive_at_drain == [0]
    assert fault.alive_at_retry and set(fault.alive_at_retry) == {0}
    assert opt.memory_stats()["oom_recoveries"] == 1
    for a, b in zip(ours, _clean_run(4)):
        assert torch.equal(a, b)  # the same update, applied once
    opt.close()


def test_a_second_oom_is_one_error_and_finish_step_completes_the_step(monkeypatch) -> None:
    ours = _params()
    opt = PagedAdamW(ours, lr=1e-2, weight_decay=0.1, page_bytes=PAGE)
    fault = KernelOOM(monkeypatch, opt, step=2, times=2)  # the retry fails too
    _set_grads(ours, 1)
    opt.step()
    _set_grads(ours, 2)
    with pytest.raises(torch.OutOfMemoryError, match="fake: could not allocate") as err:
        opt.step()
    # not raised "during handling of" the first: one error, no chained context
    assert err.value.__context__ is None and err.value.__cause__ is None
    assert any("the step is pending" in n and "finish_step()" in n
               for n in getattr(err.value, "__notes__", []))
    assert fault.alive_at_drain == [0]
    with pytest.raises(RuntimeError, match="finish_step"):
        opt.step()
    opt.finish_step()
    for step in (3, 4):
        _set_grads(ours, step)
        opt.step()
    for a, b in zip(ours, _clean_run(4)):
        assert torch.equal(a, b)
    opt.close()


def test_a_failed_restore_is_undone_after_its_buffers_are_freed(monkeypatch) -> None:
    # an optimizer under a target: an OOM at step 2 drains it; at step 3 the pressure control
    # brings pages back, and that restore runs out of memory
    from ..pressure.fakes import FakeProbe

    gen = torch.Generator().manual_seed(3)
    ours = [torch.randn(n, generator=gen) for n in SIZES]
    opt = PagedAdamW(ours, lr=1e-2, page_bytes=PAGE, target=1 << 20,
                     probe=FakeProbe(2 << 20, [lambda: 0]))
    FailOnce(opt, step=2, at=1)
    store = opt.pager
    refs: list[weakref.ref] = []
    alive_when_undone: list[int] = []
    real_limit = store.limit_device

    def failing_restore(nbytes, why):  # noqa: ANN001, ANN202
        staging = torch.empty(PAGE // 4)  # what a real restore holds when it fails
        refs.append(weakref.ref(staging))
        raise torch.OutOfMemoryError("fake: no room for the restore")

    def limit(nbytes, reason):  # noqa: ANN001, ANN202
        if reason.startswith("restore failed"):
            assert reason == "restore failed: OutOfMemoryError: fake: no room for the restore"
            alive_when_undone.append(sum(r() is not None for r in refs))
        return real_limit(nbytes, reason)

    for step in range(1, 4):
        for o in ours:
            o.grad = torch.randn(o.shape, generator=gen)
        if step == 3:
            monkeypatch.setattr(store, "restore_bytes", failing_restore)
            monkeypatch.setattr(store, "limit_device", limit)
        opt.step()
    assert refs and alive_when_undone == [0]  # before: 1 (the handler undid it)
    opt.close()
