"""The memory report's numbers equal direct counts of the tensors and tracker measurements."""

from __future__ import annotations

import json
import math

import bitsandbytes as bnb
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.checkpoint import apply as ckpt_apply
from tightfit.checkpoint.blocks import resolve_blocks
from tightfit.loss import disable_chunked_loss, enable_chunked_loss
from tightfit.measure.tracker import MemoryTracker
from tightfit.report.pieces import constant_bytes
from tightfit.report.report import measure_report

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny(hidden: int = 64, inter: int = 128, layers: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _peak(model, batch) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mt:
        out = model(**batch)
        out.loss.backward()
        del out
    model.zero_grad(set_to_none=True)
    return mt.peak_bytes


def test_report_equals_direct_counts_and_measurements(tmp_path) -> None:
    x = torch.randint(0, 128, (2, 64))
    batch = {"input_ids": x, "labels": x}
    model = tiny()
    base_numel = sum(p.numel() for p in model.parameters())
    pm = tightfit.prepare(model, checkpoint="every", loss_chunks=32, example=batch)
    opt = tightfit.optimizer_for(pm, "adamw")
    pm(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    report = measure_report(pm, batch, optimizer=opt)

    layers = [m for m in pm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    numel = sum(math.prod(m.weight.quant_state.shape) for m in layers)
    w = report.piece("base weights")
    assert w.without_bytes == 2 * numel
    assert w.with_bytes == sum(m.weight.numel() * m.weight.element_size() for m in layers)
    assert w.with_bytes * 4 == w.without_bytes  # 4 bits vs 16 bits

    c = report.piece("quantization constants")
    blocks = sum(math.ceil(math.prod(m.weight.quant_state.shape) / 64) for m in layers)
    assert c.without_bytes == 4 * blocks  # one fp32 absmax per 64 weights
    qs = [m.weight.quant_state for m in layers]
    assert c.with_bytes == sum(q.absmax.numel() + 4 * q.state2.absmax.numel() + 4 for q in qs)

    t = report.piece("trainable params + grads")
    lora = [p for p in pm.parameters() if p.requires_grad]
    assert t.without_bytes == 2 * 2 * base_numel
    assert t.with_bytes == 2 * sum(p.numel() * 4 for p in lora)  # fp32 params + fp32 grads

    a = report.piece("activations")
    assert a.with_bytes == _peak(pm, batch)
    plan = ckpt_apply.uninstall(pm)
    disable_chunked_loss(pm)
    assert a.without_bytes == _peak(pm, batch)
    assert a.with_bytes < a.without_bytes
    ckpt_apply.install(pm, resolve_blocks(pm, None), plan)
    enable_chunked_loss(pm, 32)

    o = report.piece("optimizer state")
    state = sum(v.nbytes for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    assert o.with_bytes == state and o.detail["device"] == state
    assert o.without_bytes == 8 * base_numel

    files = report.save(tmp_path)
    data = json.loads(files["json"].read_text())
    assert [r["with_bytes"] for r in data["pieces"]] == [p.with_bytes for p in report.pieces]
    assert "| activations |" in files["md"].read_text()
    assert files["png"].read_bytes()[:4] == b"\x89PNG"
    assert "quantization constants" in report.table()


def test_double_quant_is_about_0127_bits_per_param() -> None:
    # layers of 256 x 1024 weights: 4096 blocks of 64 -> 16 second-level blocks of 256
    pm = tightfit.prepare(tiny(hidden=256, inter=1024, layers=1), checkpoint=None,
                          loss_chunks=None)
    c = constant_bytes(pm)
    assert c.single_bits_per_param == 0.5
    assert 0.126 < c.double_bits_per_param < 0.128
    # same figures when the model itself was quantized without DQ
    single = constant_bytes(tightfit.prepare(tiny(hidden=256, inter=1024, layers=1),
                                             double_quant=False, checkpoint=None,
                                             loss_chunks=None))
    assert single.single_bytes == c.single_bytes and single.double_bytes == c.double_bytes
