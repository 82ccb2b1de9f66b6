"""Bad input gets a clear error and leaves the model exactly as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit.checkpoint as ck
from tightfit.checkpoint.apply import STATE_ATTR
from tightfit.checkpoint.solver import min_peak

from .conftest import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")


def _snapshot(model: nn.Module) -> tuple:
    return (
        [dict(m.__dict__).keys() for m in model.modules()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        getattr(getattr(model, "config", None), "use_cache", None),
        hasattr(model, STATE_ATTR),
    )


def _same(a: tuple, b: tuple) -> bool:
    grads_equal = all((x is None and y is None) or (x is not None and y is not None
                                                    and torch.equal(x, y))
                      for x, y in zip(a[1], b[1]))
    return a[0] == b[0] and grads_equal and a[2:] == b[2:]


@pytest.fixture(scope="module")
def llama() -> tuple:
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    x = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": x, "labels": x}
    next(model.parameters()).grad = torch.ones_like(next(model.parameters()))  # a grad to keep
    return model, batch, ck.profile(model, batch)


def test_budget_below_minimum_names_the_minimum(llama: tuple) -> None:
    model, batch, prof = llama
    before = _snapshot(model)
    need = min_peak(prof)
    with pytest.raises(ValueError, match=rf"at least {need}"):
        ck.enable(model, "budget", budget=need // 2, profiled=prof)
    with pytest.raises(ValueError, match="below the smallest peak"):
        ck.enable(model, "budget", budget=1, example=batch)  # through a fresh profile too
    assert _same(before, _snapshot(model))


def test_unknown_policy_and_bad_arguments(llama: tuple) -> None:
    model, batch, _ = llama
    before = _snapshot(model)
    with pytest.raises(ValueError, match="unknown checkpoint policy 'fastest'.*uniform:k"):
        ck.enable(model, "fastest")
    with pytest.raises(ValueError, match="uniform:k"):
        ck.enable(model, "uniform:0")
    with pytest.raises(ValueError, match="needs budget=<bytes> and example="):
        ck.enable(model, "budget", budget=10**9)
    with pytest.raises(ValueError, match="positive number of bytes"):
        ck.enable(model, "budget", budget=-5, example=batch)
    with pytest.raises(TypeError, match="policy must be a string"):
        ck.enable(model, 3)  # type: ignore[arg-type]
    assert _same(before, _snapshot(model))


def test_no_blocks_found_says_how_to_pass_them() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"blocks=list\(model.layers\)"):
        ck.enable(model, "every")
    assert "forward" not in model.__dict__
    with pytest.raises(ValueError, match="submodule"):
        ck.enable(model, "every", blocks=[nn.Linear(4, 4)])


def test_failing_example_is_reported_and_model_unchanged(llama: tuple) -> None:
    model, _, _ = llama
    before = _snapshot(model)
    wrong_dtype = {"input_ids": torch.randn(2, 8)}
    no_labels = {"input_ids": torch.randint(0, 128, (2, 8))}
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="example batch failed") as info:
        ck.enable(model, "budget", budget=10**9, example=wrong_dtype)
    assert info.value.__cause__ is not None  # the model's own error is chained
    with pytest.raises(ValueError, match="include labels"):
        ck.enable(model, "every", example=no_labels)
    with pytest.raises(TypeError, match="example must be"):
        ck.enable(model, "every", example=3.0)  # type: ignore[arg-type]
    assert _same(before, _snapshot(model))
    assert torch.equal(rng, torch.get_rng_state())


def test_failed_replan_keeps_the_installed_plan(llama: tuple) -> None:
    model, _, prof = llama
    plan = ck.enable(model, "sqrt", profiled=prof)
    with pytest.raises(ValueError):
        ck.enable(model, "budget", budget=1, profiled=prof)
    assert ck.disable(model) == plan


def test_refuses_on_top_of_hf_checkpointing() -> None:
    model = tiny_llama(layers=2)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        ck.enable(model, "every")
    model.gradient_checkpointing_disable()
    ck.enable(model, "every")
    ck.disable(model)


def test_failed_replan_with_other_blocks_keeps_the_plan_on_its_own_blocks() -> None:
    from tightfit.checkpoint import apply

    model = tiny_llama(layers=4)
    layers = list(model.model.layers)
    ck.enable(model, "every")  # on the whole chain
    x = torch.randint(0, 128, (2, 16))
    with pytest.raises(ValueError):
        ck.enable(model, "budget", budget=1, example={"input_ids": x, "labels": x},
                  blocks=layers[:2])
    plan, blocks = apply.installed(model)
    assert blocks == layers and plan.policy == "every"
    ck.profile(model, {"input_ids": x, "labels": x}, blocks=layers[:2])
    assert apply.installed(model)[1] == layers
    ck.disable(model)
