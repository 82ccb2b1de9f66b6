"""Paged base weights (tightfit.qlora.paged_base): the 4-bit weights of all but a few decoder
layers wait on the next tier and stream in one layer ahead, in forward, recompute and backward."""

from __future__ import annotations

import dataclasses
import gc

import bitsandbytes as bnb
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.qlora import paged_base
from tightfit.qlora.paged_base import (
    PagedBase,
    check_resident_layers,
    disable_paged_base,
    enable_paged_base,
    paged_base_of,
)
from tightfit.tiers import copy as copy_module
from tightfit.tiers.copy import CudaCopyEngine
from tightfit.tiers.regions import TierFullError

from ..tiers.strict_cuda import _Storage, install, uninstall

LAYERS = 4


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def batch() -> torch.Tensor:
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def prepared(checkpoint: str | None, tile: int | None = None):  # noqa: ANN201
    return tightfit.prepare(tiny(), checkpoint=checkpoint, loss_chunks=16, mlp_tile=tile,
                            lora={"r": 4, "alpha": 8})


def weights_of(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            out[name] = torch.cat([m.weight.data.flatten().view(torch.uint8),
                                   qs.absmax.flatten().view(torch.uint8),
                                   qs.state2.absmax.flatten().view(torch.uint8)]).clone()
    return out


def train(model, steps: int = 2):  # noqa: ANN001, ANN201
    opt = tightfit.optimizer_for(model, kind="adamw", lr=1e-2)
    x, losses, grads = batch(), [], []
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize(("checkpoint", "tile", "resident"), [
    ("every", None, 0), ("every", 8, 1), (None, None, 0), (None, 8, 2), ("uniform:2", None, 1),
])
def test_losses_and_lora_grads_equal_resident_weights(checkpoint, tile, resident) -> None:
    want_losses, want_grads = train(prepared(checkpoint, tile))
    model = prepared(checkpoint, tile)
    pager = enable_paged_base(model, resident)
    assert pager is not None and pager.streamed_bytes > 0
    losses, grads = train(model)
    for a, b in zip(want_losses, losses):
        assert torch.equal(a, b)
    for want, got in zip(want_grads, grads):
        assert want.keys() == got.keys() and want
        assert all(torch.equal(want[k], got[k]) for k in want)
    # every streamed layer came back in forward and in backward (one layer ahead)
    assert pager.loads >= 2 * (LAYERS - resident)
    disable_paged_base(model)


def test_weights_are_never_all_on_the_device() -> None:
    model = prepared("every")
    before = weights_of(model)
    pager = enable_paged_base(model, 0)
    assert pager is not None
    per_layer = pager.streamed_bytes / LAYERS
    seen: list[int] = []
    for block in pager.blocks:  # after the pager's own hooks: what the block runs with
        block.register_forward_pre_hook(lambda *_: seen.append(pager.device_bytes()))
    original = pager._step_to

    def counting(key):  # noqa: ANN001, ANN202
        original(key)
        seen.append(pager.device_bytes())

    pager._step_to = counting
    assert pager.device_bytes() == 0  # between steps: all on the next tier
    train(model, steps=1)
    assert len(seen) > 2 * LAYERS and max(seen) <= 2 * per_layer
    assert pager.max_streamed_loaded == 2
    assert pager.device_bytes() == 0  # the end of backward freed what was left
    disable_paged_base(model)
    after = weights_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_evaluation_and_state_dict_bring_weights_back() -> None:
    model = prepared("every")
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(input_ids=batch()).logits
    pager = enable_paged_base(model, 1)
    with torch.no_grad():
        got = model(input_ids=batch()).logits
    assert torch.equal(want, got)
    assert pager.device_bytes() == 0  # no backward follows: freed at the forward's end
    sd = model.state_dict()
    assert all(torch.equal(ref[k], sd[k]) for k in ref)
    disable_paged_base(model)
    assert paged_base_of(model) is None


def test_a_state_dict_leaves_the_streamed_weights_on_the_tier(tmp_path) -> None:  # noqa: ANN001
    """A save (peft's adapter state dict reads the full one) brings nothing back to the
    device, and the full state dict holds the real weights, loadable into a fresh model."""
    from peft import get_peft_model_state_dict

    model = prepared("every")
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    pager = enable_paged_base(model, 0)
    assert pager.device_bytes() == 0
    adapter = get_peft_model_state_dict(model)
    assert adapter and pager.device_bytes() == 0
    seen: list[int] = []
    for block in pager.blocks:  # after each block's entries are written
        block.register_state_dict_post_hook(lambda *_: seen.append(pager.device_bytes()))
    sd = model.state_dict()
    assert len(seen) == LAYERS and max(seen) == 0 and pager.device_bytes() == 0
    assert sd.keys() == ref.keys() and all(torch.equal(ref[k], sd[k]) for k in ref)
    train(model, steps=1)  # the pages come and go: the dict aliases none of them
    frozen = [k for k in ref if "lora_" not in k]
    assert len(frozen) > len(ref) / 2 and all(torch.equal(ref[k], sd[k]) for k in frozen)
    torch.save(sd, tmp_path / "sd.pt")
    fresh = prepared("every")
    for m in fresh.modules():  # what the load must bring: the base's codes too
        if isinstance(m, bnb.nn.Linear4bit):
            m.weight.data.zero_()
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=False))
    assert all(torch.equal(sd[k], v) for k, v in fresh.state_dict().items())
    disable_paged_base(model)


def _strict(monkeypatch):  # noqa: ANN001, ANN202
    """The strict CUDA emulation (tests/tiers/strict_cuda.py), started once the model is
    prepared (its quantization is not what is checked), with CUDA's copy engine and a pinned
    home on the CPU device."""
    emu = install(monkeypatch)
    monkeypatch.setattr(PagedBase, "_pinned_tier", lambda self: True)
    return emu, _track_resizes(monkeypatch, emu)


def test_the_stream_order_is_legal_under_strict_cuda(monkeypatch) -> None:  # noqa: ANN001
    """Every side-stream copy into a weight's storage is waited for before the compute reads
    it, and before the storage's memory goes back to the allocator (a resize to 0 here), with
    copies run late on the side stream and backward on its own thread."""
    model = prepared("uniform:2")
    want_losses, want_grads = train(prepared("uniform:2"), steps=1)
    emu, tracked = _strict(monkeypatch)
    roles: list[str] = []
    real_stream = copy_module.copy_stream
    monkeypatch.setattr(copy_module, "copy_stream",
                        lambda device, name: roles.append(name) or real_stream(device, name))
    try:
        pager = enable_paged_base(model, 1)
        # the weights' own side stream: a prefetch queues behind no activation offload
        assert roles == ["weights"]
        losses, grads = train(model, steps=1)
        assert tracked["allocated"] > 0 and tracked["freed"] > 0
        assert isinstance(pager.engine, CudaCopyEngine) and pager.pool.tier == "host"
        assert ("wait_event", "compute", pager.engine.stream.name) in emu.calls
        assert torch.equal(want_losses[0], losses[0])
        assert all(torch.equal(want_grads[0][k], grads[0][k]) for k in want_grads[0])
        disable_paged_base(model)
        emu.synchronize()
        assert emu.violations == []
    finally:
        uninstall(emu)


def test_the_strict_check_sees_a_free_before_the_wait(monkeypatch) -> None:  # noqa: ANN001
    """The check above can fail: freeing a prefetched layer without waiting for its copy."""
    model = prepared("every")
    emu, _ = _strict(monkeypatch)
    try:
        pager = enable_paged_base(model, 1)
        pager._load(pager.layers[0])
        pager.layers[0].handles = None  # forget the copy: no wait before the free
        pager._free(pager.layers[0])
        assert any("a paged weight" in v for v in emu.violations)
        emu.violations.clear()
        disable_paged_base(model)
    finally:
        uninstall(emu)


def _track_resizes(monkeypatch, emu) -> dict[str, int]:  # noqa: ANN001
    """The emulation tracks storages an op makes; a paged weight's storage is resized in
    place instead: count a resize to its size as an allocation on the current stream and a
    resize to 0 as the free the allocator's rule is checked at."""
    counts = {"allocated": 0, "freed": 0}
    allocate, deallocate = PagedBase._allocate, PagedBase._deallocate

    def alloc(self, piece):  # noqa: ANN001, ANN202
        allocate(self, piece)
        info = {"stream": emu.current(), "label": "a paged weight", "nbytes": piece.nbytes}
        known = {f.name for f in dataclasses.fields(_Storage)}
        emu._live[id(piece.storage)] = _Storage(**{k: v for k, v in info.items() if k in known})
        counts["allocated"] += 1

    def free(self, piece):  # noqa: ANN001, ANN202
        if id(piece.storage) in emu._live:
            seen = len(emu.violations)
            emu._freed(id(piece.storage))
            counts["freed"] += 1
            if len(emu.violations) > seen:  # a copy may still write here: let it land first
                emu.synchronize()
        deallocate(self, piece)

    monkeypatch.setattr(PagedBase, "_allocate", alloc)
    monkeypatch.setattr(PagedBase, "_deallocate", free)
    return counts


@pytest.mark.parametrize("bad", [-1, LAYERS + 1, "two", 1.5, True, None])
def test_bad_resident_layers_are_refused_naming_the_fix(bad) -> None:
    model = prepared(None)
    before = weights_of(model)
    with pytest.raises(ValueError, match="resident_layers") as err:
        enable_paged_base(model, bad)
    assert "pass" in str(err.value) or "e.g." in str(err.value)
    assert paged_base_of(model) is None
    assert all(not b._forward_pre_hooks for b in model.base_model.model.model.layers)
    after = weights_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_check_resident_layers_accepts_all_and_counts() -> None:
    assert check_resident_layers("all") == "all" and check_resident_layers("auto") == "auto"
    assert check_resident_layers(0, 4) == 0 and check_resident_layers(4, 4) == 4


@pytest.mark.parametrize("resident", ["all", "auto"])
def test_all_and_auto_page_nothing(resident) -> None:  # noqa: ANN001
    """``"auto"`` is tightfit train's planner's to choose; enabling alone pages nothing."""
    model = prepared(None)
    before = weights_of(model)
    assert enable_paged_base(model, resident) is None
    assert paged_base_of(model) is None
    assert all(not b._forward_pre_hooks for b in model.base_model.model.model.layers)
    after = weights_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_full_tier_changes_nothing(monkeypatch) -> None:  # noqa: ANN001
    model = prepared(None)
    before = weights_of(model)
    real = paged_base.disk_pool
    monkeypatch.setattr(paged_base, "disk_pool", lambda spill, grow, limit: real(spill, 4096,
                                                                                 4096))
    with pytest.raises(TierFullError):
        enable_paged_base(model, 0)
    assert paged_base_of(model) is None
    gc.collect()
    after = weights_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not b._forward_pre_hooks for b in model.base_model.model.model.layers)


def test_prepare_pages_the_weights_by_its_resident_layers_option() -> None:
    want_losses, want_grads = train(prepared("every"))
    model = tightfit.prepare(tiny(), checkpoint="every", loss_chunks=16, resident_layers=1,
                             lora={"r": 4, "alpha": 8})
    pager = paged_base_of(model)
    assert pager is not None and pager.resident_layers == 1
    assert any("paged base weights" in n for n in model.tightfit_info.notes)
    losses, grads = train(model)
    assert all(torch.equal(a, b) for a, b in zip(want_losses, losses))
    assert all(torch.equal(want_grads[-1][k], grads[-1][k]) for k in want_grads[-1])
    disable_paged_base(model)


@pytest.mark.parametrize(("kw", "match"), [
    ({"resident_layers": LAYERS + 1}, "more than the model's 4 decoder layers"),
    ({"resident_layers": -2}, "negative"),
    ({"resident_layers": 1, "quant": None}, "quant=None keeps none"),
])
def test_prepare_refuses_bad_resident_layers_before_any_change(kw, match) -> None:
    model = tiny()
    with pytest.raises(ValueError, match=match):
        tightfit.prepare(model, checkpoint=None, **kw)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def test_a_resume_save_reads_no_full_state_dict(tmp_path) -> None:  # noqa: ANN001
    """The resume state's adapter is saved from the trainable params: no block's state dict
    is read (on a 70B base that would copy every paged layer's home to host RAM), and the
    file holds what peft's own (full state dict) path writes."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from tightfit.train import resume

    model = prepared("every")
    pager = enable_paged_base(model, 1)
    opt = tightfit.optimizer_for(model, kind="adamw", lr=1e-2)
    reads: list[int] = []
    for i, block in enumerate(pager.blocks):
        block.register_state_dict_post_hook(lambda *_, i=i: reads.append(i))
    folder = resume.save_state(tmp_path, 1, model, opt, [])
    assert reads == [] and pager.device_bytes() == 0
    saved = load_file(folder / "adapter" / "adapter_model.safetensors")
    want = get_peft_model_state_dict(model)
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
    disable_paged_base(model)
