"""Profiling counts what blocks save exactly; sqrt keeps ~2√n inputs; budget beats uniform."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tightfit.checkpoint as ck
from tightfit.measure.tracker import MemoryTracker

from .chains import ComputeHeavy, MemoryHeavy, SavesOne

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")


def _measure(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mt:
        model(x).sum().backward()
    return mt.peak_bytes


def test_profile_counts_saved_bytes_exactly() -> None:
    x = torch.randn(32, 256)
    model = nn.Sequential(*[SavesOne(256) for _ in range(4)])
    prof = ck.profile(model, x)
    assert len(prof.blocks) == 4
    for b in prof.blocks:
        assert b.input_bytes == x.nbytes
        assert b.saved_bytes == x.nbytes  # the sum inside sin, nothing else
        assert not b.saves_input
    assert all(p.grad is None for p in model.parameters())  # profiling left no grads behind


def test_sqrt_keeps_about_two_sqrt_n_inputs() -> None:
    n = 16
    x = torch.randn(64, 512)
    unit = x.nbytes
    model = nn.Sequential(*[SavesOne(512) for _ in range(n)])
    prof = ck.profile(model, x)
    plan = ck.enable(model, "sqrt", profiled=prof)
    assert [len(s) for s in plan.segments] == [4, 4, 4, 4]
    measured = _measure(model, x)
    ck.disable(model)
    none = _measure(model, x)
    # √n inputs kept + one segment of √n blocks recomputed, plus a gradient or two in flight
    assert 2 * math.sqrt(n) <= measured / unit <= 2 * math.sqrt(n) + 3
    assert 2 * math.sqrt(n) <= plan.predicted_peak_bytes / unit <= 2 * math.sqrt(n) + 3
    assert none / unit >= n


def test_budget_beats_best_uniform_on_uneven_chain() -> None:
    d = 256
    x = torch.randn(64, d)
    blocks = [MemoryHeavy(d) if i % 2 == 0 else ComputeHeavy(d) for i in range(12)]
    model = nn.Sequential(*blocks)
    prof = ck.profile(model, x)
    heavy_t = sum(b.forward_s for b, m in zip(prof.blocks, blocks) if isinstance(m, ComputeHeavy))
    light_t = sum(b.forward_s for b, m in zip(prof.blocks, blocks) if isinstance(m, MemoryHeavy))
    assert heavy_t > 2 * light_t  # the chain really is uneven in time
    compared = 0
    for pol in ["every", "sqrt", "uniform:2", "uniform:4"]:
        uni = ck.enable(model, pol, profiled=prof)
        uni_measured = _measure(model, x)
        ck.disable(model)
        if uni.predicted_peak_bytes >= prof.peak_bytes:
            continue
        bud = ck.enable(model, "budget", budget=uni.predicted_peak_bytes, profiled=prof)
        bud_measured = _measure(model, x)
        ck.disable(model)
        assert bud_measured <= 1.05 * uni_measured, pol
        # budget recomputes the cheap, memory-heavy blocks only
        assert bud.predicted_recompute_fraction < 0.6 * uni.predicted_recompute_fraction, pol
        compared += 1
    assert compared >= 3
