"""pareto() is a frontier; the chunked head + loss is profiled as it really runs."""

from __future__ import annotations

import pytest
import torch

import tightfit.checkpoint as ck
from tightfit.checkpoint.solver import min_peak
from tightfit.measure.tracker import MemoryTracker

from .conftest import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")


def test_pareto_frontier_is_monotone() -> None:
    torch.manual_seed(0)
    model = tiny_llama(layers=6, hidden=32)
    x = torch.randint(0, 128, (2, 32))
    plans = ck.pareto(model, {"input_ids": x, "labels": x}, points=8)
    assert len(plans) >= 2
    assert plans[0].predicted_peak_bytes == min_peak(plans[0].profile)
    for a, b in zip(plans, plans[1:]):
        assert a.predicted_peak_bytes < b.predicted_peak_bytes
        assert a.predicted_recompute_fraction > b.predicted_recompute_fraction
    assert plans[-1].predicted_recompute_fraction == 0.0  # no checkpointing at the top
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing installed


def test_chunked_head_and_loss_is_profiled_as_it_runs() -> None:
    loss_mod = pytest.importorskip("tightfit.loss")
    torch.manual_seed(0)
    model = tiny_llama(layers=4, hidden=32, vocab=2048)
    x = torch.randint(0, 2048, (2, 64))
    batch = {"input_ids": x, "labels": x}
    plain = ck.profile(model, batch)
    loss_mod.enable_chunked_loss(model, 16)
    try:
        chunked = ck.profile(model, batch)
        assert chunked.tail_peak_bytes < 0.7 * plain.tail_peak_bytes
        plan = ck.enable(model, "every", profiled=chunked)
        model.zero_grad(set_to_none=True)
        with MemoryTracker("cpu") as mt:
            model(**batch).loss.backward()
        ck.disable(model)
    finally:
        loss_mod.disable_chunked_loss(model)
    assert mt.peak_bytes <= 1.1 * plan.predicted_peak_bytes
    assert mt.peak_bytes >= 0.8 * plan.predicted_peak_bytes
