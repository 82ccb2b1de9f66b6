"""Pressure handling that costs nothing between spikes: margins learned per interval and per
step size, and restores that stop where ordinary steps hold the state (a fake device).

A rare long batch spikes; the steps around it are short. The state must leave for the spike
and come back after it, and the short steps must neither evict nor restore: before the
margins were learned per interval, a long batch's growth made every short step keep its
headroom, so each short step evicted in backward and restored before the update.
"""

from __future__ import annotations

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW
from tightfit.pressure.target import default_target
from tightfit.pressure.watch import PressureWatch

from .fakes import FakeProbe
from .test_occupancy import PAGE, Chain, FakeDevice

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

D = 128
LENGTHS = [8, 8, 8, 128, 8, 8, 8, 8, 8, 8]  # one spike among short steps


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, t, D, generator=gen) for t in LENGTHS]


def _run(target: int, margin: int | None):  # noqa: ANN202
    """Train on the batches; per step the eviction and restore counts after it."""
    torch.manual_seed(0)
    model = Chain()
    dev = FakeDevice(model, 1 << 40)
    opt = PagedAdamW(model.parameters(), lr=1e-3, page_bytes=PAGE, target=target,
                     probe=dev.probe)
    dev.state = lambda: opt.pager.resident_bytes()
    opt.watch(model, margin_bytes=margin, min_interval_s=0.0)
    for g in range(len(opt.param_groups)):  # map the spill file now, outside the trackers
        opt.pager.spill.region(g, 0, 0)
    counts = []
    for x in _batches():
        dev.fwd_bwd(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st = opt.memory_stats()
        counts.append((st["evictions"], st["restores"], st["resident_bytes"]))
    state = opt.memory_stats()["state_bytes"]
    opt.close()
    return counts, state, dev.probe


def _calibrate() -> tuple[int, int, int]:
    """Peak usage of a short and of the long step without any state; the largest growth
    between two checks (the long step's)."""
    torch.manual_seed(0)
    model = Chain()
    dev = FakeDevice(model, 1 << 40)
    watch = PressureWatch(model, dev.probe, 1 << 40, lambda n, r: 0, min_interval_s=0.0)
    peaks = []
    for x in _batches():
        dev.probe.reset_peak()
        dev.fwd_bwd(model, x)
        peaks.append(dev.probe.peak_bytes)
        watch.reset()
    return max(p for p, n in zip(peaks, LENGTHS) if n == 8), max(peaks), \
        watch.stats.max_growth_bytes


def test_short_steps_around_a_spike_neither_evict_nor_restore() -> None:
    short, long, _ = _calibrate()
    state = 2 * sum(p.numel() * 4 for p in Chain().parameters())
    # room for a short step with all its state and a sixteenth more; the spike alone fits,
    # with its state it does not
    target = (short + state + 2 * PAGE) * 17 // 16
    assert long + state > target > long + 4 * PAGE

    counts, state_bytes, probe = _run(target, margin=None)
    spike = LENGTHS.index(128)
    evictions = [c[0] for c in counts]
    restores = [c[1] for c in counts]
    assert evictions[spike - 1] == 0 and evictions[spike] > 0  # only the spike evicts
    assert evictions[-1] == evictions[spike]  # no short step after it evicts
    assert restores[spike] > 0 and restores[-1] == restores[spike]  # back once, right away
    assert all(c[2] == state_bytes for c in counts[spike:])  # resident again for the update
    assert probe.peak_bytes <= target

    # the contrast: a margin too large for a short step at every check (what one step-wide
    # margin learns from a spike) leaves no short step room for the whole state; the restore
    # hysteresis then holds the state where they fit instead of evicting in every backward
    # and restoring before every update
    margin = target // 6  # a sixth of the target: more than a short step leaves free
    counts, _, _ = _run(target, margin=margin)
    assert all(c[2] < state_bytes for c in counts[1:])
    assert counts[-1][0] == counts[spike][0]  # no short step after the spike evicts
    assert counts[-1][1] - counts[spike][1] <= 2  # restores: a page or two, not every step


def test_a_margin_forecast_scales_with_the_step_and_the_interval() -> None:
    probe = FakeProbe(1 << 40, [lambda: level["used"]])
    level = {"used": 0}
    watch = PressureWatch(Chain(), probe, 64 << 20, lambda n, r: 0, min_interval_s=0.0)
    floor = (64 << 20) // 16
    watch._tokens = 128  # a step of 128 tokens (set by the first block's input)
    watch.check("a")
    level["used"] = 1 << 20
    watch.check("b")  # 1 MiB grew after "a"
    level["used"] = (1 << 20) + 1000
    watch.check("c")  # 1000 bytes after "b"
    watch.reset()
    assert watch.margin_at("a") == floor  # 1.25 MiB forecast: under the floor
    watch._tokens = 128 * 16  # 16 x the tokens: extrapolated, scaled and doubled
    assert watch.margin_at("a") == 2 * 16 * (1 << 20)
    assert watch.margin_at("b") == floor  # a quiet interval stays quiet
    assert watch.margin_at("never seen") == watch.margin_for(128 * 16)  # the largest one
    watch._tokens = 0
    assert watch.margin_at("a") == watch.margin_bytes  # size unknown: the step-wide margin
    assert watch.margin_for(128 * 16) == 2 * 16 * (1 << 20)
    assert watch.margin_for(128) == floor


def test_default_target_acts_where_it_can() -> None:
    cuda = FakeProbe(1 << 30)
    cuda.device = torch.device("cuda")
    assert default_target(cuda) == 0.9
    assert default_target(FakeProbe(1 << 30)) == 0.9  # a CPU probe with a capacity (cgroup)

    class NoCapacity(FakeProbe):
        def capacity_bytes(self) -> None:  # type: ignore[override]
            return None

    assert default_target(NoCapacity(1)) is None  # the CPU without a limit: nothing to act on
