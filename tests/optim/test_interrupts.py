"""Ctrl-C at any moment of step(): afterwards finish_step() completes it once, as torch's AdamW.

An interrupt is injected at each point of a page's life — before and after the kernel, after
the page is marked, before and after its write-back is queued — as a real SIGINT (the signal
Ctrl-C sends, raised at that moment: Python turns it into ``KeyboardInterrupt`` at the next
bytecode) and, where the code may raise itself, as a ``KeyboardInterrupt`` raised there. Each
run then calls ``finish_step()`` and goes on; params and state must match torch's AdamW over
every step, under the three residencies (all resident, some streamed, all streamed).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.paging import sweep as sweep_module

PAGE = 16 << 10
SIZES = [3000, 5000, 4097, 9000]  # 168 KiB of state: 11 pages of at most 16 KiB
BUDGETS = {"resident": None, "some-streamed": 6 * PAGE, "all-streamed": PAGE}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to kernel rounding (1e-6 relative); an update applied twice or lost is ~1e-2."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-6


def _tensors(seed: int, sizes: list[int] = SIZES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _sigint() -> None:
    """What Ctrl-C does at this moment: SIGINT to this process, handled by Python's handler
    (``KeyboardInterrupt`` at the next bytecode of the main thread)."""
    signal.raise_signal(signal.SIGINT)


class Fire:
    """Wraps a callable: on the ``at``-th call while armed, interrupts before or after it."""

    def __init__(self, inner: Callable[..., Any], at: int, when: str, how: str) -> None:
        self.inner, self.at, self.when, self.how = inner, at, when, how
        self.armed = False
        self.calls = 0
        self.fired = False

    def _interrupt(self) -> None:
        self.fired = True
        if self.how == "signal":
            _sigint()
        else:
            raise KeyboardInterrupt

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        now = self.armed and not self.fired and (self.calls + 1 == self.at)
        if self.armed:
            self.calls += 1
        if now and self.when == "before":
            self._interrupt()
        out = self.inner(*args, **kwargs)
        if now and self.when == "after":
            self._interrupt()
        return out


# (point, when, how): the kernel is the optimizer's _update (torch's fused kernel inside);
# mark_done records a page as updated; engine.store queues its write-back.
POINTS = [
    ("kernel", "before", "raise"),
    ("kernel", "after", "signal"),
    ("mark", "after", "raise"),
    ("mark", "after", "signal"),
    ("store", "before", "raise"),
    ("store", "after", "raise"),
    ("store", "after", "signal"),
]


def _install(opt: PagedAdamW, monkeypatch: pytest.MonkeyPatch, point: str, fire_at: int,
             when: str, how: str) -> Fire:  # fmt: skip
    if point == "kernel":
        fire = Fire(opt._update, fire_at, when, how)
        opt._update = fire  # type: ignore[method-assign]
    elif point == "mark":
        fire = Fire(sweep_module.mark_done, fire_at, when, how)
        monkeypatch.setattr(sweep_module, "mark_done", fire)
    else:
        engine = opt.pager.engine
        fire = Fire(engine.store, fire_at, when, how)
        engine.store = fire  # type: ignore[method-assign]
    return fire


def _groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Two param groups: a fully resident step makes two kernel calls (one per group)."""
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}]


@pytest.mark.parametrize("at", [1, 2, 5])
@pytest.mark.parametrize(("point", "when", "how"), POINTS, ids=["-".join(p) for p in POINTS])
@pytest.mark.parametrize("budget", BUDGETS.values(), ids=BUDGETS.keys())
def test_an_interrupt_at_any_point_then_finish_step_equals_torch(
    monkeypatch, budget, point, when, how, at
) -> None:
    if budget is None and (point == "store" or at > 2):
        pytest.skip("all resident: two kernel calls a step and no write-back")
    ref = _tensors(3)
    ours = [p.clone() for p in ref]
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = PagedAdamW(_groups(ours), lr=1e-2, weight_decay=0.1, page_bytes=PAGE,
                     device_budget=budget)
    fire = _install(opt, monkeypatch, point, at, when, how)
    for step in range(1, 6):
        for r, o, g in zip(ref, ours, _tensors(100 + step)):
            r.grad, o.grad = g, g.clone()
        ref_opt.step()
        fire.armed = step == 3
        try:
            opt.step()
        except KeyboardInterrupt:
            assert step == 3
            with pytest.raises(RuntimeError, match="finish_step"):
                opt.step()  # the step's own message says what to do ...
            fire.armed = False
            opt.finish_step()  # ... and doing it completes the step, once
        fire.armed = False
    assert fire.fired, "the interrupt was never injected"
    for r, o in zip(ref, ours):
        assert _close(o, r)
    theirs, mine = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    for i in range(len(SIZES)):
        assert float(mine[i]["step"]) == float(theirs[i]["step"]) == 5.0
        assert _close(mine[i]["exp_avg"], theirs[i]["exp_avg"])
        assert _close(mine[i]["exp_avg_sq"], theirs[i]["exp_avg_sq"])
    opt.close()


def test_an_interrupt_while_finishing_leaves_it_pending_and_a_second_call_completes_it(
    monkeypatch,
) -> None:
    ref = _tensors(3)
    ours = [p.clone() for p in ref]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    opt = PagedAdamW(ours, lr=1e-2, page_bytes=PAGE, device_budget=PAGE)  # all streamed
    fire = Fire(opt._update, 2, "after", "signal")
    opt._update = fire  # type: ignore[method-assign]
    for r, o, g in zip(ref, ours, _tensors(7)):
        r.grad, o.grad = g, g.clone()
    ref_opt.step()
    fire.armed = True
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    fire.at, fire.fired, fire.calls = 3, False, 0  # and again, inside finish_step()
    with pytest.raises(KeyboardInterrupt):
        opt.finish_step()
    fire.armed = False
    opt.finish_step()
    opt.finish_step()  # nothing pending: a no-op
    for r, o in zip(ref, ours):
        assert _close(o, r)
    opt.close()


def test_a_real_sigint_from_another_thread_during_long_steps() -> None:
    """os.kill(SIGINT) from a timer thread at random moments of streamed steps: whatever the
    moment, finish_step() completes the step and the run stays equal to torch's AdamW."""
    sizes = [40_000] * 3  # 940 KiB of state: 59 pages, all streamed through one slot
    ref = _tensors(11, sizes)
    ours = [p.clone() for p in ref]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, foreach=False)
    opt = PagedAdamW(ours, lr=1e-3, page_bytes=PAGE, device_budget=PAGE)
    inside = {"step": False}

    def handler(signum: int, frame: Any) -> None:
        if inside["step"]:  # a late signal (the step already returned) is dropped
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    rng = random.Random(5)
    interrupted = 0
    took = 0.0  # the last step's time: the signal comes within it, wherever it lands
    try:
        for step in range(1, 10):
            for r, o, g in zip(ref, ours, _tensors(200 + step, sizes)):
                r.grad, o.grad = g, g.clone()
            ref_opt.step()
            delay = rng.uniform(0.0, 0.9 * took) if step > 1 else 3600.0  # step 1: timing only
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            inside["step"] = True
            started = opt._step_id  # the step's id is taken when it starts
            t0 = time.perf_counter()
            try:
                timer.start()
                opt.step()
                took = time.perf_counter() - t0
            except KeyboardInterrupt:
                inside["step"] = False
                if opt._step_id == started:  # it came before step() began: nothing changed
                    opt.step()
                else:
                    interrupted += 1
                    opt.finish_step()
            finally:
                inside["step"] = False
                timer.cancel()
                timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted > 0, "no interrupt landed inside a step"
    for r, o in zip(ref, ours):
        assert _close(o, r)
    opt.close()
