"""The planner speaks tightfit's one vocabulary: dtype names, registry optimizer kinds and
tightfit.checkpoint's policies and segments."""

from __future__ import annotations

import json
import typing

import pytest

from tightfit.checkpoint.plan import Segment, structural_segments
from tightfit.optim.optimizer_options import OptimizerKind
from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES
from tightfit.planner.estimate import Overhead, estimate
from tightfit.planner.ladder import plan
from tightfit.planner.peak import activation_peak, plan_peak
from tightfit.planner.presets import PRESETS, ModelShape
from tightfit.planner.train_args import train_args
from tightfit.planner.train_setup import PLANNED_OPTIMIZERS, TrainSetup
from tightfit.qlora.prepare_options import PrepareOptions

SMALL = ModelShape("small", hidden=128, intermediate=352, layers=5, heads=4, kv_heads=2,
                   vocab=1000)


def test_short_dtype_names_mean_the_canonical_ones() -> None:
    short = TrainSetup(compute_dtype="bf16", lora_dtype="fp32")
    assert short == TrainSetup(compute_dtype="bfloat16", lora_dtype="float32") == TrainSetup()
    assert (short.compute_dtype, short.lora_dtype) == ("bfloat16", "float32")
    assert TrainSetup(compute_dtype="fp16").compute_dtype == "float16"
    # the same spelling rules in prepare()'s options (one table, tightfit.measure.dtypes)
    assert PrepareOptions(compute_dtype="bf16").compute_dtype == "bfloat16"
    shape = PRESETS["llama-2-7b"]
    assert plan(shape, "24GiB", compute_dtype="bf16").to_dict() == \
        plan(shape, "24GiB", compute_dtype="bfloat16").to_dict()


def test_unknown_dtype_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="compute_dtype must be one of float32, bfloat16, "
                                         "float16 .*fp32, bf16, fp16.*'int4'"):
        TrainSetup(compute_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        TrainSetup(lora_dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compute_dtype .*'auto'.* must be one of"):
        PrepareOptions(compute_dtype="fp8")  # type: ignore[arg-type]


def test_optimizers_are_registry_kinds() -> None:
    assert set(PLANNED_OPTIMIZERS) <= set(typing.get_args(OptimizerKind))
    with pytest.raises(ValueError, match="'adamw8bit'.*paged one: 'paged_adamw8bit'"):
        TrainSetup(optimizer="adamw8bit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'paged_lion' is not one the planner models; choose "
                                         "adamw, paged_adamw, paged_adamw8bit"):
        TrainSetup(optimizer="paged_lion")


@pytest.mark.parametrize("optimizer", PLANNED_OPTIMIZERS)
def test_train_accepts_every_planned_optimizer(optimizer: str) -> None:
    from tightfit.cli import build_parser
    from tightfit.train.train_command import config_from_args

    budget = 2 * DEFAULT_PAGE_BYTES  # whole pages, as the ladder sizes it (one is the least)
    setup = TrainSetup(compute_dtype="fp16", optimizer=optimizer,  # type: ignore[arg-type]
                       optimizer_device_budget=budget)
    cfg = config_from_args(build_parser().parse_args(["train", *train_args(setup)]))
    assert cfg.optimizer.kind == optimizer
    assert cfg.prepare.compute_dtype == "float16"
    assert cfg.optimizer.device_budget == (budget if setup.paged else None)


def test_selective_is_refused() -> None:
    with pytest.raises(ValueError, match="'selective' is not modelled by the planner"):
        TrainSetup(checkpoint="selective")
    setup = TrainSetup(seq_len=16)
    with pytest.raises(ValueError, match="selective checkpoint segments are not modelled"):
        plan_peak(SMALL, setup, structural_segments("selective", None, SMALL.layers))


@pytest.mark.parametrize("policy", ["none", "every", "sqrt", "uniform:2"])
def test_structural_plans_are_checkpoints_own(policy: str) -> None:
    name, _, k = policy.partition(":")
    _, _, segments, _ = activation_peak(SMALL, TrainSetup(seq_len=16, checkpoint=policy))
    assert segments == structural_segments(name, int(k) if k else None, SMALL.layers)  # type: ignore[arg-type]


def test_budget_plan_and_its_json() -> None:
    setup = TrainSetup(seq_len=64, batch_size=2, compute_dtype="float32", lora_r=8)
    none = sum(plan_peak(SMALL, setup, structural_segments("none", None, SMALL.layers)))
    every = sum(plan_peak(SMALL, setup, structural_segments("every", None, SMALL.layers)))
    est = estimate(SMALL, setup.with_(checkpoint="budget", checkpoint_budget=(none + every) // 2),
                   Overhead(0, 0))
    segs = est.segments
    assert all(isinstance(s, Segment) and s.kind in ("stored", "checkpoint") for s in segs)
    assert [s.start for s in segs] == [0, *(s.stop for s in segs[:-1])]  # contiguous
    assert segs[-1].stop == SMALL.layers
    assert {s.kind for s in segs} == {"stored", "checkpoint"}
    # docs/plan.md: checkpoint_segments is [start, stop, checkpointed] per segment
    report = plan("llama-3-8b", "24GiB", seq_len=4096, batch_size=2)
    row = next(r for r in report.rows if r.setup.checkpoint == "budget")
    out = json.loads(json.dumps(report.to_dict()))
    listed = out["rows"][report.rows.index(row)]["checkpoint_segments"]
    assert listed == [[s.start, s.stop, s.kind == "checkpoint"] for s in row.estimate.segments]
    assert all(type(a) is int and type(b) is int and type(c) is bool for a, b, c in listed)
    assert {c for _, _, c in listed} == {True, False}
