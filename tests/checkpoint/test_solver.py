"""Budget plans against measured peaks on a 12-block Llama; the solver against fixed plans."""

from __future__ import annotations

import pytest
import torch

import tightfit.checkpoint as ck
from tightfit.checkpoint.solver import make_plan, min_peak
from tightfit.measure.tracker import MemoryTracker

from .conftest import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")

BASELINES = ["every", "sqrt", "uniform:2", "uniform:3", "uniform:6", "selective"]


def _measure(model: torch.nn.Module, batch: dict) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mt:
        model(**batch).loss.backward()
    return mt.peak_bytes


@pytest.fixture(scope="module")
def sweep() -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_llama(layers=12, hidden=64, vocab=256)
    x = torch.randint(0, 256, (2, 96))
    batch = {"input_ids": x, "labels": x}
    prof = ck.profile(model, batch)
    lo = min_peak(prof)
    hi = prof.peak_bytes
    results: dict[str, list] = {"budget": [], "baseline": []}
    for pol in BASELINES:
        plan = ck.enable(model, pol, profiled=prof)
        results["baseline"].append((plan, _measure(model, batch)))
        ck.disable(model)
    # budgets: a geometric sweep plus exactly the baselines' predicted peaks
    budgets = {int(lo * (hi / lo) ** (i / 7)) for i in range(8)}
    budgets |= {p.predicted_peak_bytes for p, _ in results["baseline"]}
    for b in sorted(budgets, reverse=True):
        plan = ck.enable(model, "budget", budget=b, profiled=prof)
        results["budget"].append((b, plan, _measure(model, batch)))
        ck.disable(model)
    results["profile"] = prof
    return results


def test_measured_peak_within_predicted_and_budget(sweep: dict) -> None:
    for b, plan, measured in sweep["budget"]:
        assert plan.predicted_peak_bytes <= b
        assert measured <= 1.1 * plan.predicted_peak_bytes, (b, plan.segments)
        assert measured <= 1.1 * b
    for plan, measured in sweep["baseline"]:
        assert measured <= 1.1 * plan.predicted_peak_bytes, plan.policy
        # and the prediction is not a loose bound either
        assert measured >= 0.8 * plan.predicted_peak_bytes, plan.policy


def test_peak_never_rises_as_budget_shrinks(sweep: dict) -> None:
    measured = [m for _, _, m in sweep["budget"]]  # budgets in decreasing order
    assert len(measured) >= 6
    for hi, lo in zip(measured, measured[1:]):
        assert lo <= hi * 1.01


def test_recompute_never_worse_than_fixed_plans(sweep: dict) -> None:
    for _, plan, measured in sweep["budget"]:
        for base, base_measured in sweep["baseline"]:
            if base_measured >= measured and base.policy != "selective":
                assert (plan.predicted_recompute_fraction
                        <= base.predicted_recompute_fraction + 1e-12), (plan, base.policy)


def test_smallest_budget_is_exact_boundary(sweep: dict) -> None:
    prof = sweep["profile"]
    lo = min_peak(prof)
    make_plan(prof, "budget", budget=lo)
    with pytest.raises(ValueError, match=f"at least {lo}"):
        make_plan(prof, "budget", budget=lo - 1)
