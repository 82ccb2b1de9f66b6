"""enable/disable: gradients equal the unchecked run for every policy; disable is exact."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import tightfit.checkpoint as ck
from tightfit.measure.tracker import MemoryTracker

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


@pytest.mark.parametrize("policy", ["none", "every", "uniform:2", "uniform:1", "selective"])
def test_block_hooks_run_in_the_recompute(policy: str) -> None:
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    x = torch.randint(0, 128, (2, 8))
    batch = {"input_ids": x, "labels": x}
    layers = list(model.model.layers)
    pre, post, kw_keys = [0] * 4, [0] * 4, [set() for _ in range(4)]

    def pre_hook(i: int):
        def hook(_m, _args, kwargs) -> None:
            pre[i] += 1
            kw_keys[i].add(frozenset(kwargs))
        return hook

    def post_hook(i: int):
        def hook(_m, _args, _out) -> None:
            post[i] += 1
        return hook

    handles = [h for i, b in enumerate(layers)
               for h in (b.register_forward_pre_hook(pre_hook(i), with_kwargs=True),
                         b.register_forward_hook(post_hook(i)))]
    plan = ck.enable(model, policy)
    try:
        model(**batch).loss.backward()
    finally:
        ck.disable(model)
        for h in handles:
            h.remove()
    runs = 1 if policy == "none" else 2  # forward, then the recompute in backward
    assert plan.checkpointed_blocks == (0 if policy == "none" else 4)
    assert pre == post == [runs] * 4
    # the recompute passes the same keyword arguments (position embeddings, mask, ...)
    assert all(len(k) == 1 and k != {frozenset()} for k in kw_keys)


@pytest.mark.parametrize("policy", ["every", "uniform:1"])
def test_hooks_that_edit_inputs_or_outputs_act_once(policy: str) -> None:
    # The recompute calls the blocks as modules: a pre-hook that edits a block's input must
    # see the input as the caller passed it (not act twice), and a hook that edits an output
    # must act on the recomputed one too, or backward would use other activations.
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    x = torch.randint(0, 128, (2, 8))
    batch = {"input_ids": x, "labels": x}

    def halve_input(_m, args, kwargs):
        if args:
            return (args[0] * 0.5, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.5}

    def scale_output(_m, _args, out):
        return out * 1.5 if isinstance(out, torch.Tensor) else (out[0] * 1.5, *out[1:])

    handles = [model.model.layers[1].register_forward_pre_hook(halve_input, with_kwargs=True),
               model.model.layers[2].register_forward_hook(scale_output)]
    try:
        loss0, g0 = loss_and_grads(model, batch)
        ck.enable(model, policy)
        loss1, g1 = loss_and_grads(model, batch)
    finally:
        ck.disable(model)
        for h in handles:
            h.remove()
    assert torch.equal(loss0, loss1)
    assert _max_diff(g0, g1) <= 1e-6


def test_pressure_watch_sees_the_recompute_in_backward() -> None:
    from tightfit.pressure.watch import PressureWatch

    from ..pressure.fakes import FakeProbe

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 16)) for _ in range(3))
            self.head = torch.nn.Linear(16, 4)

        def get_output_embeddings(self) -> torch.nn.Module:  # the watch hooks the head too
            return self.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return self.head(x)

    model = Chain()
    order: list[str] = []
    phase = {"now": "forward"}
    probe = FakeProbe(100, [lambda: 99])  # always under pressure: every check calls back

    def evict(need: int, reason: str) -> int:
        order.append(f"{phase['now']}/{reason}")
        return 0

    watch = PressureWatch(model, probe, 50, evict, margin_bytes=0, min_interval_s=0.0)
    ck.enable(model, "uniform:1")  # the three layers, recomputed as one segment
    try:
        out = model(torch.randn(2, 5, 16)).sum()
        phase["now"] = "backward"
        out.backward()
    finally:
        ck.disable(model)
        watch.remove()
    fwd = [f"forward/forward:layers.{i}" for i in range(3)] + ["forward/forward:head"]
    # the recompute is a forward pass inside backward: the watch checks before each block,
    # after the gradient reaches the segment and before the segment's own backward
    recompute = [f"backward/forward:layers.{i}" for i in range(3)]
    bwd = [f"backward/backward:layers.{i}" for i in (1, 0)]
    assert order == [*fwd, "backward/backward:head", "backward/backward:layers.2",
                     *recompute, *bwd]
