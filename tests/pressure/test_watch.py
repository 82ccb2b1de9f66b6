"""Target resolution and the model-watching hooks (forward and backward pre-hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.measure.tracker import MemoryTracker
from tightfit.pressure.probes import RSSProbe
from tightfit.pressure.target import resolve_target
from tightfit.pressure.watch import PressureWatch, find_watch_blocks

from .fakes import FakeProbe
from .trace import sample_everywhere

MiB = 2**20


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Blocks(nn.Module):
    """A chain of MLP blocks with a head: activations grow with the sequence length."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )
        self.head = nn.Linear(d, 8)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_resolve_target_fractions_bytes_and_defaults() -> None:
    probe = FakeProbe(1000)
    assert resolve_target(0.9, probe) == 900
    assert resolve_target(1.0, probe) == 1000
    assert resolve_target(640, probe) == 640
    with pytest.raises(ValueError, match="target is required"):
        resolve_target(None, probe)  # the CPU has no default
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        resolve_target(1.5, probe)
    with pytest.raises(ValueError, match="positive"):
        resolve_target(0, probe)
    with pytest.raises(TypeError, match="fraction"):
        resolve_target(True, probe)
    with pytest.raises(TypeError, match="fraction"):
        resolve_target("90%", probe)  # type: ignore[arg-type]
    unknown = RSSProbe()
    if unknown.capacity_bytes() is None:
        with pytest.raises(ValueError, match="does not know its capacity"):
            resolve_target(0.5, unknown)


def test_find_watch_blocks_takes_the_layers_and_the_head() -> None:
    model = Blocks(n=3)
    assert find_watch_blocks(model) == [*model.layers, model.head]


def _run(model: nn.Module, x: torch.Tensor, tracker_sink: dict) -> None:
    with MemoryTracker("cpu") as mt:
        tracker_sink["mt"] = mt
        model(x).square().mean().backward()
    tracker_sink["mt"] = None


def test_watch_evicts_before_a_spike_passes_the_target() -> None:
    model = Blocks()
    sink: dict = {"mt": None}
    pool = {"resident": 6 * MiB}  # stands for the optimizer pages on the device

    def live() -> int:
        return sink["mt"].current_bytes if sink["mt"] is not None else 0

    probe = FakeProbe(16 * MiB, [live, lambda: pool["resident"]], base_bytes=1 * MiB)
    target = 14 * MiB
    calls: list[tuple[int, str]] = []

    def evict(need: int, reason: str) -> int:
        freed = min(need, pool["resident"])
        pool["resident"] -= freed
        calls.append((freed, reason))
        return freed

    # one long block's forward activations: input + 2 hidden, fp32 (the growth between checks)
    long_x = torch.randn(1, 2048, 32)
    margin = 2 * 4 * 2048 * (32 + 8 * 32)
    watch = PressureWatch(model, probe, target, evict, margin_bytes=margin, min_interval_s=0.0)
    sample_everywhere(model, probe)

    _run(model, torch.randn(1, 16, 32), sink)  # short: plenty of headroom, nothing moves
    assert calls == [] and pool["resident"] == 6 * MiB
    _run(model, long_x, sink)  # long: the hooks drain the pool as activations grow
    assert calls, "the long batch should have triggered evictions"
    assert probe.peak_bytes <= target, (probe.peak_bytes, target)
    assert any(r.startswith("forward:layers.") for _, r in calls)
    assert watch.stats.triggers == len(calls)
    assert watch.stats.freed_bytes == 6 * MiB - pool["resident"]

    # the same spike, unwatched and with the pool back, passes the target and the capacity
    watch.remove()
    pool["resident"] = 6 * MiB
    probe.reset_peak()
    _run(model, long_x, sink)
    assert probe.peak_bytes > probe.capacity_bytes()


class _Mark(torch.autograd.Function):
    """Identity that logs when autograd runs it: ``"run:<name>"`` forward (also when a
    checkpointed block is recomputed in backward), ``"grad:<name>"`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: list[str], name: str) -> torch.Tensor:  # noqa: ANN001
        ctx.log, ctx.name = log, name
        log.append(f"run:{name}")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        ctx.log.append(f"grad:{ctx.name}")
        return grad, None, None


class MarkedBlock(nn.Module):
    """An MLP block whose first and last ops log (see :class:`_Mark`): its backward starts
    with ``grad:<name>`` (the last op's backward) and, checkpointed, recomputes from
    ``run:<name><`` (the first op's forward, run again)."""

    def __init__(self, d: int, log: list[str], name: str, checkpointed: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.log, self.name, self.checkpointed = log, name, checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = _Mark.apply(x, self.log, f"{self.name}<")
        return _Mark.apply(self.net(x), self.log, self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class MarkedChain(Blocks):
    def __init__(self, log: list[str], checkpointed: bool, d: int = 32, n: int = 2) -> None:
        super().__init__(d, n)
        self.layers = nn.ModuleList(
            MarkedBlock(d, log, f"layers.{i}", checkpointed) for i in range(n)
        )


@pytest.mark.parametrize("checkpointed", [False, True], ids=["stored", "checkpointed"])
def test_backward_hook_fires_before_the_block_backward(checkpointed: bool) -> None:
    log: list[str] = []
    model = MarkedChain(log, checkpointed)
    probe = FakeProbe(100, [lambda: 99])  # always under pressure: every check calls back

    def evict(need: int, reason: str) -> int:
        log.append(reason)
        return 0

    PressureWatch(model, probe, 50, evict, margin_bytes=0, min_interval_s=0.0)
    model(torch.randn(2, 4, 32)).sum().backward()
    checks = [e for e in log if e.startswith(("forward:", "backward:"))]
    fwd = ["forward:layers.0", "forward:layers.1", "forward:head"]
    bwd = ["backward:head", "backward:layers.1", "backward:layers.0"]
    assert checks == fwd + bwd
    backward = log[log.index("backward:head") :]
    for name in ("layers.1", "layers.0"):
        # the block's own backward work: its ops' gradients and, checkpointed, its recompute
        own = [i for i, e in enumerate(backward) if e.split(":")[1].rstrip("<") == name
               and not e.startswith("backward:")]  # fmt: skip
        assert own, f"{name}'s backward never ran"
        assert backward.index(f"backward:{name}") < min(own), backward
        assert f"grad:{name}" in backward
        if checkpointed:
            assert f"run:{name}<" in backward  # recomputed, after the check
        else:
            assert not any(e.startswith("run:") for e in backward)  # nothing recomputed


def test_rate_limit_skips_readings_only_while_headroom_is_plentiful() -> None:
    model = Blocks(n=4)
    level = {"used": 10}
    probe = FakeProbe(1000, [lambda: level["used"]])
    watch = PressureWatch(model, probe, 900, lambda n, r: 0, margin_bytes=50, min_interval_s=3600)
    model(torch.randn(2, 4, 32)).sum().backward()
    assert watch.stats.hook_calls == 10  # 5 forward + 5 backward
    assert watch.stats.reads == 1  # the first reading; the rest inside the interval
    level["used"] = 820  # headroom 80 < 2 x margin: every hook reads now
    watch.check("manual", force=True)
    reads = watch.stats.reads
    model(torch.randn(2, 4, 32)).sum().backward()
    assert watch.stats.reads == reads + 10
    watch.remove()
    model(torch.randn(2, 4, 32)).sum().backward()
    assert watch.stats.hook_calls == 21  # removed hooks no longer run


def test_the_callbacks_time_is_kept_apart_from_the_hooks_own() -> None:
    model = Blocks(n=2)
    level = {"used": 10}
    probe = FakeProbe(1000, [lambda: level["used"]])
    calls: list[int] = []

    def relieve(need: int, reason: str) -> int:
        calls.append(need)
        level["used"] -= need
        return need

    watch = PressureWatch(model, probe, 900, relieve, margin_bytes=50, min_interval_s=0)
    model(torch.randn(2, 4, 32)).sum().backward()
    assert not calls and watch.stats.callback_s == 0.0  # nothing asked: no callback time
    level["used"] = 880  # 20 bytes under the target: the next check asks for 30
    model(torch.randn(2, 4, 32)).sum().backward()
    assert calls and calls[0] == 30
    # the pager counts the callback (its eviction) as its own time; the hooks' own is the rest
    assert 0.0 < watch.stats.callback_s < watch.stats.time_s
    watch.remove()


def test_adaptive_margin_learns_growth_between_checks() -> None:
    model = Blocks(n=3)
    sink: dict = {"mt": None}
    probe = FakeProbe(1 << 40, [lambda: sink["mt"].current_bytes if sink["mt"] else 0])
    watch = PressureWatch(model, probe, 64 * MiB, lambda n, r: 0, min_interval_s=0.0)
    assert watch.margin_bytes == 4 * MiB  # 1/16 of the target before any growth is seen
    _run(model, torch.randn(1, 4096, 32), sink)
    assert watch.stats.max_growth_bytes >= 4 * 4096 * 8 * 32  # at least one hidden activation
    assert watch.margin_bytes == max(4 * MiB, 2 * watch.stats.max_growth_bytes)


class PeakProbe(FakeProbe):
    """A fake probe whose high-water mark also saw a transient between readings."""

    def __init__(self) -> None:
        super().__init__(1 << 40, [lambda: 0])
        self.transient: int | None = None

    def interval_peak_bytes(self) -> int | None:
        peak, self.transient = self.transient, None
        return peak


def test_margin_learns_transients_from_the_high_water_mark() -> None:
    probe = PeakProbe()
    watch = PressureWatch(Blocks(n=1), probe, 64 * MiB, lambda n, r: 0, min_interval_s=0.0)
    watch.check("a")
    probe.transient = 10 * MiB  # a block's temporaries came and went between the checks
    watch.check("b")
    assert watch.stats.max_growth_bytes == 10 * MiB
    assert watch.margin_bytes == 20 * MiB


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"target_bytes": 0}, ValueError),
        ({"margin_bytes": 100}, ValueError),
        ({"min_interval_s": -1.0}, ValueError),
        ({"on_pressure": None}, TypeError),
    ],
)
def test_watch_rejects_bad_input(kwargs: dict, err: type) -> None:
    args = {"target_bytes": 100, "on_pressure": lambda n, r: 0, **kwargs}
    with pytest.raises(err):
        PressureWatch(Blocks(n=1), FakeProbe(1000), **args)
