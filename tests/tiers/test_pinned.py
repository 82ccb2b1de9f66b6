"""Pinned host memory counted as pinned (``tightfit/tiers/pinned.py``), under the emulation of
torch's pinned allocator and cudaHostRegister (``tests/tiers/strict_pinned.py``).

Sizes are the 8B long-context shapes scaled from GiB to MiB: a pool asked for 17 "GiB" must
not pin 32, a closed pool must leave nothing pinned, and a budget must hold for the bytes
really pinned, not the bytes asked.
"""

from __future__ import annotations

import pytest
import torch

from tightfit.tiers import pinned
from tightfit.tiers.pinned import PinnedHost, TierFullError, pinned_size, torch_pinned_size
from tightfit.tiers.regions import pinned_pool, tier_capacity

from .strict_pinned import strict_pinned  # noqa: F401 (the fixture)

MiB = 1 << 20


def test_a_pool_pins_what_it_is_asked_not_the_next_power_of_two(strict_pinned) -> None:  # noqa: F811
    pool = pinned_pool(17 * MiB, None)
    region = pool.take(17 * MiB - 100)
    assert region.view.is_pinned()
    assert torch_pinned_size(17 * MiB) == 32 * MiB  # what torch's allocator would pin
    assert strict_pinned.pinned_bytes == pinned_size(17 * MiB) == 17 * MiB
    pool.give(region)
    pool.close()


def test_a_closed_pool_leaves_nothing_pinned(strict_pinned) -> None:  # noqa: F811
    pool = pinned_pool(3 * MiB, None)
    regions = [pool.take(MiB) for _ in range(5)]  # a second chunk grows the pool
    assert pool.chunks_made > 1 and strict_pinned.pinned_bytes == pool.capacity_bytes
    for r in regions:
        pool.give(r)
    pool.close()
    assert strict_pinned.pinned_bytes == 0 and strict_pinned.registered == {}


def test_a_pool_budget_holds_for_the_bytes_really_pinned(strict_pinned) -> None:  # noqa: F811
    pool = pinned_pool(17 * MiB, 20 * MiB)
    pool.take(17 * MiB)
    assert strict_pinned.peak_pinned_bytes <= 20 * MiB
    with pytest.raises(TierFullError, match="budget of 20971520 bytes"):
        pool.take(4 * MiB)
    assert strict_pinned.peak_pinned_bytes <= 20 * MiB
    pool.close()


def test_one_budget_for_every_user_and_a_refusal_pins_nothing(strict_pinned) -> None:  # noqa: F811
    host = PinnedHost(budget=24 * MiB)
    with pinned.sharing(host):
        activations = pinned_pool(17 * MiB, None)  # takes the accountant in effect now
    activations.take(MiB)
    pages = pinned_pool(MiB, None, host=host, what="optimizer host pages")
    pages.take(6 * MiB)
    assert host.pinned_bytes == strict_pinned.pinned_bytes == 23 * MiB
    with pytest.raises(TierFullError, match=r"optimizer host pages would pass the host budget "
                                            r"of 25165824 bytes \(24117248 pinned: offloaded "
                                            r"activations 17825792, optimizer host pages 6291456"):
        pages.take(2 * MiB)
    assert host.pinned_bytes == strict_pinned.pinned_bytes == 23 * MiB  # nothing half-made
    assert host.stats()["requested_bytes"] == 23 * MiB
    activations.close()
    pages.close()
    assert host.pinned_bytes == strict_pinned.pinned_bytes == 0


def test_the_machine_room_and_the_cgroup_bound_what_is_pinned(strict_pinned, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(pinned, "cgroup_room", lambda: 5 * MiB)
    assert tier_capacity("host") <= 5 * MiB
    room, bound = pinned.host_room()
    assert room == 5 * MiB and "cgroup" in bound
    with pytest.raises(TierFullError, match=r"5242880 bytes can be now \(the memory cgroup"):
        pinned_pool(6 * MiB, None).take(6 * MiB)
    assert strict_pinned.pinned_bytes == 0


def test_a_failed_registration_is_a_tier_error_and_counts_nothing(strict_pinned) -> None:  # noqa: F811
    host = PinnedHost()
    strict_pinned.fail_register = 1
    with pytest.raises(TierFullError, match="cudaHostRegister could not lock"):
        host.pin(MiB, "test")
    assert host.pinned_bytes == strict_pinned.pinned_bytes == 0
    buf = host.pin(MiB + 1, "test")
    assert buf.tensor.numel() == MiB + 1 and buf.pinned_bytes == MiB + pinned.PAGE
    buf.release()
    buf.release()  # twice: nothing more
    assert host.pinned_bytes == strict_pinned.pinned_bytes == 0


def test_a_bad_budget_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="e.g. 32 << 30"):
        PinnedHost(budget=-1)


def test_the_emulation_rounds_and_caches_as_torch_does(strict_pinned) -> None:  # noqa: F811
    a = torch.empty(17 * MiB, dtype=torch.uint8, pin_memory=True)
    assert a.is_pinned() and strict_pinned.pinned_bytes == 32 * MiB
    del a
    assert strict_pinned.pinned_bytes == 32 * MiB  # freed: cached, still pinned
    b = torch.empty(20 * MiB, dtype=torch.uint8, pin_memory=True)  # same size class: reused
    assert strict_pinned.pinned_bytes == 32 * MiB
    del b
    torch.accelerator.empty_host_cache()
    assert strict_pinned.pinned_bytes == 0


def test_release_syncs_before_unlocking_and_the_emulation_sees_when_not(strict_cuda, strict_pinned) -> None:  # noqa: F811, E501
    from tightfit.tiers.copy import CudaCopyEngine

    engine = CudaCopyEngine(torch.device("cpu"))
    slot = torch.zeros(MiB, dtype=torch.uint8)
    buf = PinnedHost().pin(MiB, "test")
    engine.wait(engine.load(buf.tensor, slot))  # an H2D from it, still queued on the stream
    rt = torch.cuda.cudart()
    rt.cudaHostUnregister(buf.tensor.untyped_storage().data_ptr())  # no sync first: caught
    assert any("while a stream may still copy" in v for v in strict_pinned.violations)
    strict_pinned.violations.clear()
    strict_pinned.register(buf.tensor.untyped_storage().data_ptr(), buf.pinned_bytes, 1)
    engine.wait(engine.load(buf.tensor, slot))
    buf.release()  # PinnedHost.release synchronizes the device first: no violation
    assert strict_pinned.violations == [] and strict_pinned.registered == {}
    engine.close()
