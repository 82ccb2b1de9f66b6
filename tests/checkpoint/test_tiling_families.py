"""Tiled MLPs of MoE families (Mixtral, Qwen3-MoE, gpt-oss) and Phi-3's fused gate_up:
the same loss, router logits and gradients as untiled, plain and NF4 + LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import tightfit
import tightfit.checkpoint as ck
from tightfit.checkpoint.tiling import disable_tiling, enable_tiling, tiling_of

from .families import FAMILIES, MOE, batch, rel, tiny

TOL = 2e-5  # fp32: the same math in other row blocks (matmul summation order)
KIND = {"mixtral": "experts", "qwen3_moe": "experts", "gpt_oss": "experts",
        "phi3": "fused_gate_up"}


def _step(model: nn.Module, b: dict, **kw) -> tuple[torch.Tensor, tuple, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**b, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logits = tuple(t.detach().clone() for t in (getattr(out, "router_logits", None) or ()))
    return out.loss.detach(), logits, grads


def _compare(untiled: tuple, tiled: tuple, tol: float = TOL) -> None:
    (l0, r0, g0), (l1, r1, g1) = untiled, tiled
    assert abs(l1.item() - l0.item()) <= tol * abs(l0.item())
    assert len(r0) == len(r1)
    for a, b in zip(r0, r1):  # one [tokens, experts] tensor per layer, as untiled
        assert a.shape == b.shape and rel(b, a) <= tol
    assert g0.keys() == g1.keys() and g0
    for n, g in g0.items():
        assert rel(g1[n], g) <= tol, (n, rel(g1[n], g))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_equals_untiled_full_precision(family: str) -> None:
    # every weight trains (the router too) and the router's load-balancing loss is in the
    # loss: its gradient reaches the router through the full router logits
    model = tiny(family)
    b = batch()
    kw = {"output_router_logits": True} if family in MOE else {}
    untiled = _step(model, b, **kw)
    info = enable_tiling(model, 5)  # 48 tokens: 10 tiles, the last one shorter
    assert info.kinds == (KIND[family],) * 2 and info.layers == 2
    try:
        tiled = _step(model, b, **kw)
    finally:
        disable_tiling(model)
    _compare(untiled, tiled)
    if family in MOE:
        assert len(untiled[1]) == 2 and untiled[1][0].shape == (48, model.config.num_experts
                                                                 if family == "qwen3_moe" else
                                                                 model.config.num_local_experts)
        router = [n for n in untiled[2] if "router" in n or ".gate." in n]
        assert router and all(untiled[2][n].abs().sum() > 0 for n in router)
    assert all("forward" not in m.__dict__ for m in model.modules() if hasattr(m, "has_gate"))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_equals_untiled_nf4_with_lora(family: str) -> None:
    # tightfit.prepare: NF4 experts (tightfit.qlora.experts) with LoRA on every expert weight
    # (ParamWrapper), NF4 linears elsewhere, the chunked loss (which adds the router's
    # load-balancing loss itself, from the recorded router logits); the tile is installed by
    # prepare, after LoRA
    base = tiny(family, **({"output_router_logits": True} if family in MOE else {}))
    b = batch()
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    kw = dict(checkpoint=None, loss_chunks=16, lora=lora)
    untiled_pm = tightfit.prepare(copy.deepcopy(base), **kw)
    tiled_pm = tightfit.prepare(copy.deepcopy(base), mlp_tile=7, **kw)
    adapters = dict(tiled_pm.named_parameters())
    for n, p in untiled_pm.named_parameters():
        if "lora_B" in n:  # B starts at zero; make the adapters do something
            nn.init.normal_(p, std=0.05)
        if p.requires_grad:  # the same adapters in both
            adapters[n].data.copy_(p.data)
    info = tiling_of(tiled_pm.get_base_model()) or tiling_of(tiled_pm)
    assert info is not None and info.kinds == (KIND[family],) * 2
    untiled, tiled = _step(untiled_pm, b), _step(tiled_pm, b)
    assert len(untiled[1]) == (2 if family in MOE else 0)  # router logits, one per layer
    experts = [n for n in untiled[2] if ".experts." in n or "gate_up_proj" in n]
    assert experts and all(untiled[2][n].abs().sum() > 0 for n in experts)
    _compare(untiled, tiled)


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_tiled_under_every_layer_checkpointing(family: str) -> None:
    model = get_peft_model(tiny(family), LoraConfig(r=4, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    b = batch()
    untiled = _step(model, b)
    enable_tiling(model, 8)
    ck.enable(model, "every")
    try:
        tiled = _step(model, b)
    finally:
        ck.disable(model)
        disable_tiling(model)
    _compare(untiled, tiled)


def test_dense_and_moe_layers_of_one_model_each_tile_by_their_kind() -> None:
    model = tiny("qwen3_moe", mlp_only_layers=[0])  # layer 0 is a dense Qwen3MoeMLP
    b = batch()
    untiled = _step(model, b)
    assert enable_tiling(model, "auto").kinds == ("gate_up_down", "experts")
    tiled = _step(model, b)
    disable_tiling(model)
    _compare(untiled, tiled)


def test_experts_wrapped_after_tiling_are_refused_not_silently_wrong() -> None:
    model = tiny("mixtral")
    enable_tiling(model, 8)
    # peft replaces mlp.experts by a wrapper around the tiled module: the tiled recompute
    # would run without the adapters, so the call refuses and says what to do
    pm = get_peft_model(model, LoraConfig(r=2, target_parameters=["experts.gate_up_proj"]))
    with pytest.raises(RuntimeError, match="wrapped again after tiling"):
        pm(**batch())
    disable_tiling(model)
    assert pm(**batch()).loss.isfinite()


def test_experts_called_by_keyword_and_in_eval() -> None:
    model = tiny("gpt_oss").eval()
    experts = model.model.layers[0].mlp.experts
    h, idx = torch.randn(30, 64), torch.randint(0, 4, (30, 2))
    w = torch.rand(30, 2)
    with torch.no_grad():
        want = experts(h, idx, w)  # (transformers' grouped_mm path takes them positionally)
        enable_tiling(model, 4)
        got = experts(h, router_indices=idx, routing_weights=w)
        got_pos = experts(h, idx, w)
        with pytest.raises(TypeError, match="called without 'routing_weights'"):
            experts(h, router_indices=idx)
    disable_tiling(model)
    assert rel(got, want) <= TOL and torch.equal(got, got_pos)
