"""enable/disable: gradients equal the unchecked run for every policy; disable is exact."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import tightfit.checkpoint as ck
from tightfit.memory.tracker import MemoryTracker

from .conftest import loss_and_grads, tiny_llama

FIXED = ["none", "every", "sqrt", "uniform:2", "uniform:4", "selective"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def dropout_setup() -> tuple:
    torch.manual_seed(0)
    model = tiny_llama(layers=6, dropout=0.2)
    x = torch.randint(0, 128, (2, 24))
    batch = {"input_ids": x, "labels": x}
    ref = loss_and_grads(model, batch)
    # dropout is really active: another seed gives another loss
    assert not torch.equal(loss_and_grads(model, batch, seed=2)[0], ref[0])
    return model, batch, ref


@pytest.mark.parametrize("policy", FIXED + ["budget"])
def test_grads_equal_with_dropout(dropout_setup: tuple, policy: str) -> None:
    model, batch, (loss0, g0) = dropout_setup
    budget = None
    if policy == "budget":
        budget = ck.enable(model, "every", example=batch).predicted_peak_bytes
        ck.disable(model)
    ck.enable(model, policy, budget=budget, example=batch if policy == "budget" else None)
    try:
        loss1, g1 = loss_and_grads(model, batch)
    finally:
        ck.disable(model)
    assert torch.equal(loss0, loss1)
    assert _max_diff(g0, g1) <= 1e-6


@pytest.fixture(scope="module")
def lora_setup() -> tuple:
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(layers=4, dropout=0.1),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    x = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": x, "labels": x}
    return model, batch, loss_and_grads(model, batch), ck.profile(model, batch)


@pytest.mark.parametrize("policy", FIXED + ["budget"])
def test_grads_equal_frozen_base_lora(lora_setup: tuple, policy: str) -> None:
    model, batch, (loss0, g0), prof = lora_setup
    assert all("lora_" in n for n in g0)  # base frozen, only adapters train
    budget = (prof.peak_bytes + ck.enable(model, "every", profiled=prof).predicted_peak_bytes) // 2
    ck.disable(model)
    # no enable_input_require_grads() needed
    plan = ck.enable(model, policy, budget=budget, profiled=prof)
    if policy == "budget":
        assert plan.checkpointed_blocks > 0
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mt:
        model(**batch).loss.backward()
    assert 0.8 * plan.predicted_peak_bytes <= mt.peak_bytes <= 1.1 * plan.predicted_peak_bytes
    loss1, g1 = loss_and_grads(model, batch)
    ck.disable(model)
    assert torch.equal(loss0, loss1)
    assert _max_diff(g0, g1) <= 1e-6


def test_checkpointing_really_saves_memory_and_disable_is_exact() -> None:
    model = tiny_llama(layers=8, hidden=64)
    x = torch.randint(0, 128, (2, 64))
    batch = {"input_ids": x, "labels": x}
    layer_dict = dict(model.model.layers[0].__dict__)

    def peak() -> int:
        model.zero_grad(set_to_none=True)
        with MemoryTracker("cpu") as mt:
            model(**batch).loss.backward()
        return mt.peak_bytes

    loss0, g0 = loss_and_grads(model, batch)
    p_none = peak()
    ck.enable(model, "every")
    assert model.config.use_cache is False
    p_every = peak()
    assert ck.disable(model) is not None
    assert ck.disable(model) is None  # idempotent
    assert p_every < 0.6 * p_none
    loss1, g1 = loss_and_grads(model, batch)
    assert torch.equal(loss0, loss1) and _max_diff(g0, g1) == 0.0
    assert model.model.layers[0].__dict__.keys() == layer_dict.keys()
    assert model.config.use_cache is True
    assert abs(peak() - p_none) <= 0.02 * p_none


def test_eval_forward_under_no_grad_is_plain() -> None:
    model = tiny_llama(layers=4)
    x = torch.randint(0, 128, (1, 8))
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=x).logits
    ck.enable(model, "sqrt")
    with torch.no_grad():
        out = model(input_ids=x).logits
    ck.disable(model)
    assert torch.equal(ref, out)


def test_sequential_and_kwargs_free_chain() -> None:
    torch.manual_seed(0)
    seq = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3),
                                                    torch.nn.Tanh()) for _ in range(5)])
    x = torch.randn(4, 8, requires_grad=True)

    def run() -> tuple:
        seq.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(3)
        seq(x).sum().backward()
        return x.grad.clone(), [p.grad.clone() for p in seq.parameters()]

    gx0, g0 = run()
    ck.enable(seq, "uniform:2")
    gx1, g1 = run()
    ck.disable(seq)
    assert torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
