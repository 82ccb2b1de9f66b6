"""Target occupancy on a training loop with activation spikes (a fake device, deterministic).

Every third batch is a long sequence whose activations plus a fully resident AdamW state exceed
the fake device's capacity. The fake probe counts what a real device would hold: params, live
tensors made by forward/backward (activations and grads, counted by the lead's MemoryTracker),
and the optimizer's state on the device (the page store's own byte count).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.measure.tracker import MemoryTracker
from tightfit.optim.adamw import PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD
from tightfit.pressure.occupancy import OccupancyControl
from tightfit.pressure.probes import CudaProbe, RSSProbe
from tightfit.pressure.watch import PressureWatch

from .fakes import FakeProbe
from .trace import sample_everywhere

D, LAYERS, SHORT, LONG, EVERY, STEPS = 128, 8, 8, 512, 3, 7
PAGE = 64 << 10

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    n = [LONG if i % EVERY == EVERY - 1 else SHORT for i in range(STEPS)]
    return [torch.randn(1, t, D, generator=gen) for t in n]


class FakeDevice:
    """Usage = params + live forward/backward tensors + optimizer state on the device."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.trackers: list[MemoryTracker] = []
        self.state = lambda: 0
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        self.probe = FakeProbe(capacity, [self._live, lambda: self.state()], base_bytes=params)

    def _live(self) -> int:
        return sum(t.current_bytes for t in self.trackers)

    def fwd_bwd(self, model: nn.Module, x: torch.Tensor) -> None:
        tracker = MemoryTracker("cpu")
        self.trackers.append(tracker)
        with tracker:  # grads made here stay counted until zero_grad frees them
            model(x).square().mean().backward()


def _train(opt_kind: str, capacity: int, target: int = 0, margin: int = 0):  # noqa: ANN202
    torch.manual_seed(0)
    model = Chain()
    dev = FakeDevice(model, capacity)
    sample_everywhere(model, dev.probe)
    if opt_kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())
        dev.state = lambda: state_bytes if opt.state else 0
    elif opt_kind == "calibrate":  # no optimizer state at all: what the batches alone need
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        watch = PressureWatch(model, dev.probe, 1 << 40, lambda n, r: 0, min_interval_s=0.0)
    else:
        opt = PagedAdamW(model.parameters(), lr=1e-3, page_bytes=PAGE, target=target,
                         probe=dev.probe)
        # Resident pages only: the streaming window is made by evictions inside forward and
        # backward, where the trackers already count it as a live tensor (asserted below).
        dev.state = lambda: opt.pager.resident_bytes()
        watch = opt.watch(model, margin_bytes=margin, min_interval_s=0.0)
        for g in range(len(opt.param_groups)):  # map the spill file now, outside the trackers
            opt.pager.spill.region(g, 0, 0)
    for x in _batches():
        dev.fwd_bwd(model, x)
        dev.probe.used_bytes()  # after backward, before the step
        opt.step()
        dev.probe.used_bytes()
        opt.zero_grad(set_to_none=True)
    extra = watch.stats.max_growth_bytes if opt_kind == "calibrate" else opt
    return model, dev.probe, extra


def test_spikes_stay_under_the_target_and_training_matches_torch() -> None:
    # What the batches need without any optimizer state, and the growth between two checks.
    _, calib, growth = _train("calibrate", 1 << 40)
    need = calib.peak_bytes
    margin = growth + PAGE
    state_bytes = 2 * sum(p.numel() * 4 for p in Chain().parameters())
    target = need + 2 * PAGE + margin + PAGE  # the spike, a two-page window, the margin
    capacity = target + (1 << 20)
    assert need + state_bytes > capacity  # the scenario: a spike plus full state does not fit

    ref_model, torch_probe, _ = _train("torch", capacity)
    model, probe, opt = _train("paged", capacity, target, margin)

    # without paging the same run passes the capacity (a real device would have failed)
    assert torch_probe.peak_bytes > capacity
    # with tightfit the probe never read more than the target, at any of its readings
    assert probe.peak_bytes <= target, (probe.peak_bytes, target)
    assert probe.reads > 50 * STEPS
    # and training is AdamW's: same params as torch.optim.AdamW on the same batches
    for p, r in zip(model.parameters(), ref_model.parameters()):
        rel = ((p.double() - r.double()).norm() / r.double().norm()).item()
        assert rel <= 1e-6
    stats = opt.memory_stats()
    events = opt.paging_events()
    assert stats["evictions"] >= 2 and stats["restores"] >= 2  # drained on each spike, refilled
    assert any(e.kind == "evict" and e.reason.startswith("forward:") for e in events)
    assert any(e.kind == "restore" and e.reason.startswith("headroom") for e in events)
    assert stats["resident_bytes"] == stats["state_bytes"]  # the last batch is short: all back
    assert all(e.nbytes > 0 and e.src and e.dst and e.time > 0 for e in events)
    # every eviction came from a watch hook (so the window was counted by the trackers)
    assert all(e.reason.startswith(("forward:", "backward:")) for e in events if e.kind == "evict")
    opt.close()


def test_first_step_places_only_what_fits_under_the_target() -> None:
    ps = [nn.Parameter(torch.randn(64 << 10)) for _ in range(4)]  # 2 MiB of AdamW state
    used = {"other": 3 << 20}
    probe = FakeProbe(8 << 20, [lambda: used["other"]])
    opt = PagedAdamW(ps, page_bytes=PAGE, target=4 << 20, probe=probe)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    stats = opt.memory_stats()
    assert 0 < stats["resident_bytes"] < stats["state_bytes"]
    assert stats["device_bytes"] <= (4 << 20) - (3 << 20)
    opt.close()


def test_eviction_on_the_cpu_really_leaves_rss() -> None:
    # Pages written to the MAP_SHARED spill file stay in RSS until unmapped, and freed 4 MiB
    # buffers can stay in glibc's heap: the control releases both, so an RSS probe sees it.
    ps = [nn.Parameter(torch.randn(1 << 20)) for _ in range(4)]  # 32 MiB of AdamW state
    probe = RSSProbe(capacity_bytes=64 << 30)
    opt = PagedAdamW(ps, page_bytes=4 << 20, target=32 << 30, probe=probe)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = probe.used_bytes()
    freed = opt.set_pressure(target=32 << 30, probe=probe).relieve(32 << 20, "test")
    after = probe.used_bytes()
    assert freed >= 24 << 20  # all but the two-page window
    assert before - after >= 20 << 20, (before - after) >> 20
    assert opt.memory_stats()["disk_bytes"] >= 24 << 20
    opt.close()


def test_target_errors_name_the_fix() -> None:
    p = [nn.Parameter(torch.zeros(10))]
    with pytest.raises(ValueError, match="target is required on 'cpu'"):
        PagedAdamW(p).watch(Chain())
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        PagedAdamW(p, target=1.5, probe=FakeProbe(100))
    with pytest.raises(TypeError, match="Probe"):
        PagedAdamW(p, target=100, probe=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="restore_margin_bytes"):
        OccupancyControl(PagedAdamW(p).pager, FakeProbe(100), 50, restore_margin_bytes=-1)


@pytest.mark.cuda
def test_cuda_spikes_drain_pages_to_host_and_training_matches_torch() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(1, 4096 if i % 3 == 2 else 8, D, generator=gen) for i in range(6)]

    def run(paged: bool) -> tuple[list[torch.Tensor], PagedAdamW | None]:
        torch.manual_seed(0)
        model = Chain().to(dev)
        if paged:
            probe = CudaProbe(dev)
            torch.cuda.synchronize()
            params = sum(p.numel() * 4 for p in model.parameters())
            # room for grads, the whole state, short batches and the watch's 48 MiB margin
            # (with less, target - margin sits below what params + state use, every reading
            # evicts and nothing ever comes back); not for a long batch's activations
            # (8 blocks x 4096 tokens x 1152 floats, ~150 MB)
            target = probe.used_bytes() + 3 * params + (64 << 20)
            opt = PagedAdamW(model.parameters(), lr=1e-3, page_bytes=PAGE, target=target,
                             probe=probe)
            opt.watch(model, margin_bytes=48 << 20, min_interval_s=0.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for x in batches:
            model(x.to(dev)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()], opt if paged else None

    ref, _ = run(paged=False)
    torch.cuda.empty_cache()  # the reference's memory must not count against the target
    ours, opt = run(paged=True)
    for p, r in zip(ours, ref):
        assert ((p.double() - r.double()).norm() / r.double().norm()).item() <= 1e-6
    events = opt.paging_events()
    assert any(e.kind == "evict" and e.dst == "host" for e in events)
    assert any(e.kind == "restore" and e.src == "host" for e in events)
    opt.close()


def _all_paged_optimizers() -> list:
    return [
        (PagedAdamW, {}), (PagedAdamW8bit, {}), (PagedAdam8bit, {}), (PagedLion, {}),
        (PagedLion8bit, {}), (PagedSGD, {"lr": 0.1, "momentum": 0.9}),
    ]


@pytest.mark.parametrize(("cls", "kw"), _all_paged_optimizers())
def test_every_paged_optimizer_takes_target_and_probe(cls, kw) -> None:  # noqa: ANN001
    ps = [nn.Parameter(torch.randn(64 << 10)) for _ in range(4)]
    used: dict = {"other": 0, "opt": None}
    probe = FakeProbe(16 << 20, [lambda: used["other"], lambda: used["opt"].pager.device_bytes])
    opt = cls(ps, page_bytes=PAGE, target=8 << 20, probe=probe, **kw)
    used["opt"] = opt
    for i, other in enumerate([0, 8 << 20, 0]):
        used["other"] = other  # a spike that outlives backward at the second step
        for p in ps:
            p.grad = torch.full_like(p, 0.01 * (i + 1))
        opt.step()
    stats = opt.memory_stats()
    assert stats["evictions"] >= 1 and stats["restores"] >= 1
    assert stats["resident_bytes"] == stats["state_bytes"]
    opt.close()
