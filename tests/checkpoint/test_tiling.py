"""Tiled MLPs: outputs and grads equal the untiled run (dropout, NF4, checkpointed, chunked
loss); exact undo; bad input refused. Bytes and attention: ``test_tiling_memory.py``."""

from __future__ import annotations

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import tightfit.checkpoint as ck
from tightfit.checkpoint.tiling import (
    auto_tile_tokens,
    disable_tiling,
    enable_tiling,
    run_tiles,
    tiling_of,
)
from tightfit.loss import disable_chunked_loss, enable_chunked_loss
from tightfit.qlora.quantize import quantize_linears

from . import tiled
from .conftest import loss_and_grads, tiny_llama

TILES = [1, 5, 64]  # one token, a non-divisor of the 2 × 13 tokens, more than all of them


def _close(a: dict, b: dict, tol: float = 1e-6) -> None:
    """Equal within ``tol`` of each tensor's scale (at least 1): tiles sum in another order."""
    assert a.keys() == b.keys() and a
    for n in a:
        scale = max(1.0, a[n].abs().max().item())
        assert (a[n] - b[n]).abs().max().item() <= tol * scale, n


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [b.mlp for b in ck.find_blocks(model)]


@functools.cache
def _plain_reference_forward(tile: int):
    """An MLP forward that runs the tiles through plain autograd (no recompute): it draws
    dropout masks in the same order as the tiled forward does."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run_tiles(type(self).forward.__get__(self), x, tile)
    return forward


def _reference_tiled(model: nn.Module, tile: int) -> list[nn.Module]:
    mlps = _mlps(model)
    for m in mlps:
        m.forward = _plain_reference_forward(tile).__get__(m)
    return mlps


@pytest.mark.parametrize("tile", TILES)
def test_model_loss_and_grads_equal_untiled(tile: int) -> None:
    model = tiny_llama(layers=3)
    batch = tiled.batch()
    ref = loss_and_grads(model, batch)
    info = enable_tiling(model, tile)
    assert info.layers == 3 and tiling_of(model) == info
    try:
        got = loss_and_grads(model, batch)
    finally:
        disable_tiling(model)
    assert abs(ref[0] - got[0]).item() <= 1e-6
    _close(ref[1], got[1])


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("lora", [False, True])
def test_mlp_output_input_grad_and_param_grads_equal_untiled(tile: int, lora: bool) -> None:
    mlp = tiled.mlp(16, 40)
    if lora:
        mlp = get_peft_model(nn.Sequential(mlp), LoraConfig(r=3, target_modules=[
            "gate_proj", "up_proj", "down_proj"])).base_model.model[0]
        for n, p in mlp.named_parameters():
            if "lora_B" in n:  # peft starts B at zero; make every factor's grad non-trivial
                nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 9, 16, requires_grad=True)  # batch 3: tiles cross sequence boundaries
    g = torch.randn(3, 9, 16)

    def run() -> dict[str, torch.Tensor]:
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        y = mlp(x)
        y.backward(g)
        grads = {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}
        return {"y": y.detach(), "x": x.grad.clone(), **grads}

    ref = run()
    tiled.tile_one(mlp, tile)
    _close(ref, run())
    assert len(ref) == (8 if lora else 5)  # y, x + 6 LoRA factors, or y, x + 3 weights


@pytest.fixture(scope="module")
def lora_dropout_model() -> tuple:
    torch.manual_seed(0)
    model = tiled.lora(tiny_llama(layers=3), dropout=0.3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1)
    return model, tiled.batch()


@pytest.mark.parametrize("tile", [1, 5])
@pytest.mark.parametrize("policy", [None, "every"])
def test_lora_dropout_masks_replayed_in_recompute(lora_dropout_model: tuple, tile: int,
                                                  policy: str | None) -> None:
    model, batch = lora_dropout_model
    # the reference: the same tiles through plain autograd, so the same dropout masks
    mlps = _reference_tiled(model, tile)
    ref = loss_and_grads(model, batch)
    rng_after_ref = torch.get_rng_state()
    for m in mlps:
        del m.forward
    assert not torch.equal(loss_and_grads(model, batch, seed=2)[0], ref[0])  # dropout is on
    enable_tiling(model, tile)
    if policy:
        ck.enable(model, policy)
    try:
        got = loss_and_grads(model, batch)
        rng_after = torch.get_rng_state()
    finally:
        ck.disable(model)
        disable_tiling(model)
    assert torch.equal(ref[0], got[0])
    _close(ref[1], got[1])
    assert torch.equal(rng_after_ref, rng_after)  # backward's recompute left the RNG alone


def test_one_tile_with_dropout_equals_the_untiled_model(lora_dropout_model: tuple) -> None:
    model, batch = lora_dropout_model
    ref = loss_and_grads(model, batch)
    enable_tiling(model, 1000)
    try:
        got = loss_and_grads(model, batch)
    finally:
        disable_tiling(model)
    assert torch.equal(ref[0], got[0])
    _close(ref[1], got[1])


def test_frozen_nf4_base_with_lora() -> None:
    torch.manual_seed(0)
    base = tiny_llama(layers=2, hidden=64)
    for p in base.parameters():
        p.requires_grad_(False)
    quantize_linears(base)
    model = tiled.lora(base, dropout=0.0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1)
    batch = tiled.batch()
    ref = loss_and_grads(model, batch)
    enable_tiling(model, 5)
    ck.enable(model, "every")
    try:
        got = loss_and_grads(model, batch)
    finally:
        ck.disable(model)
        disable_tiling(model)
    assert abs(ref[0] - got[0]).item() <= 1e-6
    _close(ref[1], got[1])
    assert all("lora_" in n for n in got[1])  # the NF4 weights took no grad
    assert any(".mlp.down_proj.lora_A" in n for n in got[1])


def test_with_chunked_loss() -> None:
    model = tiled.lora(tiny_llama(layers=2), dropout=0.0)
    batch = tiled.batch()
    enable_chunked_loss(model, 7)
    try:
        ref = loss_and_grads(model, batch)
        enable_tiling(model, 5)
        ck.enable(model, "every")
        got = loss_and_grads(model, batch)
    finally:
        ck.disable(model)
        disable_tiling(model)
        disable_chunked_loss(model)
    assert abs(ref[0] - got[0]).item() <= 1e-6
    _close(ref[1], got[1])


def test_bf16_close_to_untiled_and_grads_keep_their_dtype() -> None:
    model = tiny_llama(layers=2, hidden=64).to(torch.bfloat16)
    batch = tiled.batch(seq=40)
    ref = loss_and_grads(model, batch)
    enable_tiling(model, 7)
    try:
        got = loss_and_grads(model, batch)
    finally:
        disable_tiling(model)
    assert all(g.dtype == torch.bfloat16 for g in got[1].values())
    for n in ref[1]:
        scale = ref[1][n].float().abs().max().item()
        assert (ref[1][n].float() - got[1][n].float()).abs().max().item() <= 0.02 * scale + 1e-3, n


def test_eval_under_no_grad_is_tiled_and_equal() -> None:
    model = tiny_llama(layers=2).eval()
    ids = tiled.batch()["input_ids"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        enable_tiling(model, 4)
        got = model(input_ids=ids).logits
    disable_tiling(model)
    assert (ref - got).abs().max().item() <= 1e-6


def test_disable_restores_exactly_and_enable_replaces() -> None:
    model = tiny_llama(layers=2)
    mlps = _mlps(model)
    custom = mlps[1].forward  # an instance-level forward that was there before: kept
    mlps[1].forward = custom
    before = {k: v.clone() for k, v in model.state_dict().items()}
    enable_tiling(model, 3)
    enable_tiling(model, "auto")  # replaces, does not stack
    assert tiling_of(model).tile_tokens == "auto"
    assert mlps[0].forward.__tightfit_original__ == type(mlps[0]).forward.__get__(mlps[0])
    assert disable_tiling(model).tile_tokens == "auto"
    assert "forward" not in mlps[0].__dict__ and mlps[1].__dict__["forward"] is custom
    assert tiling_of(model) is None and disable_tiling(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("tile", [0, -3, 2.5, True, "big", None])
def test_bad_tile_is_refused_and_changes_nothing(tile: object) -> None:
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="tile_tokens must be a positive int"):
        enable_tiling(model, tile)  # type: ignore[arg-type]
    assert tiling_of(model) is None and all("forward" not in m.__dict__ for m in _mlps(model))


class _Block(nn.Module):
    def __init__(self, mlp: nn.Module | None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        if mlp is not None:
            self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_model_without_mlps_is_refused() -> None:
    model = nn.Sequential(_Block(None), _Block(None))
    with pytest.raises(ValueError, match="has no 'mlp' submodule"):
        enable_tiling(model)
    with pytest.raises(ValueError, match="no chain of repeated blocks"):
        enable_tiling(nn.Linear(3, 3))


def test_mlp_that_is_not_gate_up_down_is_refused_and_nothing_patched() -> None:
    good = tiled.mlp(8, 16)
    gpt2_like = nn.Module()
    gpt2_like.c_fc, gpt2_like.c_proj = nn.Linear(8, 32), nn.Linear(32, 8)
    model = nn.Sequential(_Block(good), _Block(gpt2_like))
    with pytest.raises(ValueError, match=r"block 1's mlp: Module is not an MLP tiling knows "
                                         r"\(its children are \['c_fc', 'c_proj'\]\)"):
        enable_tiling(model, 4)
    assert "forward" not in good.__dict__ and tiling_of(model) is None
    with pytest.raises(ValueError, match="modules must name"):
        enable_tiling(model, 4, modules="not a name")


def test_auto_tile_rule() -> None:
    # min(hidden, ceil(tokens·hidden/intermediate)), at least 64 tokens, at most all of them
    assert auto_tile_tokens(512, 1792, 1024) == 293
    assert auto_tile_tokens(512, 1792, 100_000) == 512
    assert auto_tile_tokens(512, 1792, 100) == 64
    assert auto_tile_tokens(512, 1792, 40) == 40
    gate_up_down = nn.Module()  # the right children, but no widths to size an auto tile from
    gate_up_down.gate_proj, gate_up_down.up_proj, gate_up_down.down_proj = (
        nn.Identity(), nn.Identity(), nn.Identity())
    model = nn.Sequential(_Block(gate_up_down), _Block(tiled.mlp(8, 16)))
    with pytest.raises(ValueError, match="cannot tell the intermediate size"):
        enable_tiling(model, "auto")
    assert tiling_of(model) is None and "forward" not in gate_up_down.__dict__
    assert enable_tiling(model, 8).layers == 2  # an explicit tile needs no width
