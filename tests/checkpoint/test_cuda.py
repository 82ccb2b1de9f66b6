"""The same checks on CUDA (allocator statistics), and offload of segment inputs."""

from __future__ import annotations

import pytest
import torch

import tightfit.checkpoint as ck
from tightfit.measure.tracker import MemoryTracker

from .conftest import loss_and_grads, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore:tightfit.checkpoint")]


def _measure(model: torch.nn.Module, batch: dict) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cuda") as mt:
        model(**batch).loss.backward()
    return mt.peak_bytes


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_budget_plans_fit_and_offload_keeps_grads(offload: bool) -> None:
    torch.manual_seed(0)
    model = tiny_llama(layers=12, hidden=256, vocab=4096, dropout=0.1).cuda()
    x = torch.randint(0, 4096, (2, 256), device="cuda")
    batch = {"input_ids": x, "labels": x}
    loss0, g0 = loss_and_grads(model, batch)
    prof = ck.profile(model, batch)
    for pol in ["every", "sqrt"]:
        plan = ck.enable(model, pol, profiled=prof, offload=offload)
        measured = _measure(model, batch)
        loss1, g1 = loss_and_grads(model, batch)
        ck.disable(model)
        assert measured <= 1.1 * plan.predicted_peak_bytes, (pol, measured, plan)
        assert torch.equal(loss0, loss1)
        assert max((g0[n] - g1[n]).abs().max().item() for n in g0) <= 1e-6
    budget = (prof.peak_bytes + ck.enable(model, "every", profiled=prof).predicted_peak_bytes) // 2
    ck.disable(model)
    plan = ck.enable(model, "budget", budget=budget, profiled=prof, offload=offload)
    measured = _measure(model, batch)
    ck.disable(model)
    assert measured <= 1.1 * plan.predicted_peak_bytes and measured <= 1.1 * budget


@pytest.mark.parametrize("kinds", [["stored_offload"], ["checkpoint_offload"],
                                   ["stored_offload", "checkpoint_offload", "stored",
                                    "checkpoint"]])
def test_cuda_offload_placements_keep_grads_and_fit(kinds: list[str]) -> None:
    from tightfit.checkpoint.offload import tier_speed
    from tightfit.checkpoint.plan import OffloadTier

    from .offloaded import MIN_BYTES, install, offloader

    torch.manual_seed(0)
    model = tiny_llama(layers=8, hidden=256, vocab=4096, dropout=0.1).cuda()
    x = torch.randint(0, 4096, (2, 256), device="cuda")
    batch = {"input_ids": x, "labels": x}
    loss0, g0 = loss_and_grads(model, batch)
    prof = ck.profile(model, batch)
    bandwidth, latency = tier_speed(torch.device("cuda", 0), "host")
    tier = OffloadTier("host", bandwidth, True, MIN_BYTES, latency_s=latency)
    plan = install(model, prof, kinds, tier=tier)
    try:
        off = offloader(model)
        measured = _measure(model, batch)
        loss1, g1 = loss_and_grads(model, batch)
        assert off.pool.chunks_made == 1 and off.bytes_offloaded > 0
    finally:
        ck.disable(model)
    assert torch.equal(loss0, loss1)
    assert max((g0[n] - g1[n]).abs().max().item() for n in g0) <= 1e-6
    assert 0.9 * plan.predicted_peak_bytes <= measured <= 1.1 * plan.predicted_peak_bytes


def test_cuda_budget_plan_with_auto_offload_fits() -> None:
    from .offloaded import MIN_BYTES

    torch.manual_seed(0)
    model = tiny_llama(layers=8, hidden=256, vocab=4096).cuda()
    x = torch.randint(0, 4096, (2, 256), device="cuda")
    batch = {"input_ids": x, "labels": x}
    prof = ck.profile(model, batch)
    every = ck.enable(model, "every", profiled=prof).predicted_peak_bytes
    ck.disable(model)
    budget = (prof.peak_bytes + every) // 2
    plan = ck.enable(model, "budget", budget=budget, profiled=prof, offload="auto",
                     offload_min_bytes=MIN_BYTES)
    try:
        measured = _measure(model, batch)
    finally:
        ck.disable(model)
    assert plan.tier is None or plan.tier.name == "host"
    assert measured <= 1.1 * plan.predicted_peak_bytes and measured <= 1.1 * budget
