"""MoE experts (transformers 5's fused 3-D weights): NF4 per expert, LoRA through peft's
parameter targets, numerics against peft + transformers on the unquantized model."""

from __future__ import annotations

import copy
import math

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from peft import PeftModel
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import tightfit
from tightfit.measure.tracker import MemoryTracker
from tightfit.qlora.experts import expert_specs, is_4bit_experts

V = 128
# NF4 holds a weight to within 15 % of its norm (the dense tests' 4-bit tolerance,
# tests/qlora/test_prepare.py). A step's adapter gradients through a 4-bit base differ from the
# unquantized model's by about as much: measured on the tiny dense Llama 0.12-0.13 (all adapter
# grads as one vector), here 0.09-0.18 over three seeds, where NF4 also moves a few tokens to
# other experts (top-k routing is not continuous). Against a reference holding the same NF4
# values dequantized, the step is the same up to float summation order.
NF4_GRAD_TOL = 0.25
NF4_LOSS_TOL = 1e-2
EXACT_TOL = 1e-5


def tiny(family: str, **kw) -> nn.Module:
    """A 2-layer model of ``family`` from its config (``kw`` overrides config fields)."""
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
               num_experts_per_tok=2)
    if family == "mixtral":
        cls, config = MixtralForCausalLM, MixtralConfig
        cfg |= dict(intermediate_size=128, num_local_experts=4)
    elif family == "qwen3_moe":
        cls, config = Qwen3MoeForCausalLM, Qwen3MoeConfig
        cfg |= dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16)
    else:
        cls, config = GptOssForCausalLM, GptOssConfig
        cfg |= dict(intermediate_size=64, num_local_experts=4, head_dim=16)
    model = cls(config(**(cfg | kw)))
    for name, p in model.named_parameters():  # gpt-oss initializes these to zero
        if name.endswith(("_bias", "router.bias", "sinks")):
            nn.init.normal_(p, std=0.1)
    return model


FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {n.removeprefix("base_model.model.").replace(".base_layer", ""): m
            for n, m in model.named_modules() if hasattr(m, "has_gate") and "lora" not in n}


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (2, 24))
    return {"input_ids": ids, "labels": ids}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).double().norm() / b.double().norm().clamp_min(1e-30)).item()


def step(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**b).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_bytes_are_what_bitsandbytes_gives_each_expert(family: str) -> None:
    model = tiny(family)
    originals = {n: {w: getattr(m, w).detach().clone() for w in ("gate_up_proj", "down_proj")}
                 for n, m in experts_of(model).items()}
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None, lora={"r": 2})
    assert {f"{n}.{w}" for n, ws in originals.items() for w in ws} <= set(pm.tightfit_info.quantized)
    assert not [n for n, p in pm.named_parameters() if p.is_floating_point() and p.dim() >= 3]
    for name, module in experts_of(pm).items():
        assert is_4bit_experts(module)
        for w, spec in expert_specs(module).items():
            stack = originals[name][w]
            for e in range(stack.shape[0]):
                # the model's layout is [E, out, in]; gpt-oss' [E, in, out]
                weight = stack[e].t() if module.is_transposed else stack[e]
                q, qs = bnbF.quantize_4bit(weight.contiguous(), blocksize=64,
                                           compress_statistics=True, quant_type="nf4")
                got = spec.quant_state(module, e)
                n = weight.numel()
                assert getattr(module, w)[e].nbytes == math.ceil(n / 2) == q.nbytes
                assert torch.equal(getattr(module, w)[e], q.view(-1))
                assert torch.equal(got.absmax, qs.absmax) and got.absmax.nbytes == math.ceil(n / 64)
                assert torch.equal(got.state2.absmax, qs.state2.absmax)
                assert torch.equal(got.offset, qs.offset) and tuple(got.shape) == tuple(qs.shape)
                # what bitsandbytes' own dequantization gives (its CPU kernel's error is
                # shape- and machine-dependent: 0.09 for a randn 32x64, 0.40 for a 64x32 on
                # this one)
                want = bnbF.dequantize_4bit(q, qs).to(stack.dtype)
                want = want.t() if module.is_transposed else want
                assert torch.allclose(spec.dequantize(module, e), want)
    # 4-bit storage between steps: a forward and backward leave it packed
    pm(**batch()).loss.backward()
    assert not [n for n, p in pm.named_parameters() if p.is_floating_point() and p.dim() >= 3]


def _dequantized_reference(pm: nn.Module, ref: nn.Module) -> nn.Module:
    """``ref`` with every weight that ``pm`` holds in 4 bits replaced by its dequantized
    value, and the rest of pm's base copied: the same function as pm, computed by transformers
    and peft on plain tensors."""
    ref = copy.deepcopy(ref)
    base = pm.get_base_model()
    for name, module in base.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            target = ref.get_submodule(name.replace(".base_layer", ""))
            target.weight.data = bnbF.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif is_4bit_experts(module):
            target = ref.get_submodule(name.replace(".base_layer", ""))
            for w, spec in expert_specs(module).items():
                stack = [spec.dequantize(module, e) for e in range(spec.num_experts)]
                getattr(target, w).data = torch.stack(stack)
    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_matches_peft_on_the_unquantized_model(family: str, tmp_path) -> None:
    ref = tiny(family)
    r = 4
    # dropout 0: plain peft refuses to load an expert adapter whose config has dropout
    pm = tightfit.prepare(copy.deepcopy(ref), checkpoint=None, loss_chunks=None,
                          lora={"r": r, "alpha": 8, "dropout": 0.0})
    for n, p in pm.named_parameters():
        if "lora_B" in n:  # B starts at zero; make the adapters do something
            nn.init.normal_(p, std=0.05)
    # adapters on every expert weight: one rank-r pair per expert, and nothing else trains
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    for name, module in experts_of(pm).items():
        for w, spec in expert_specs(module).items():
            assert f"{name}.{w}" in pm.tightfit_info.adapted
            out_f, in_f = spec.out_in
            adapter = [p for n, p in trainable.items() if n.startswith(f"base_model.model.{name}.")
                       and n.count(".base_layer") == (0 if w == "down_proj" else 1)]
            assert sum(p.numel() for p in adapter) == r * spec.num_experts * (in_f + out_f)
    b = batch()
    loss, grads = step(pm, b)
    expert_grads = {n: g for n, g in grads.items() if ".experts." in n}
    assert len(expert_grads) == 4 * 2 and all(g.abs().sum() > 0 for g in expert_grads.values())

    # peft's own files, loaded by plain peft onto the unquantized model (its ParamWrapper
    # parametrizes the whole 3-D weight; transformers runs its own experts forward)
    pm.save_pretrained(tmp_path)
    exact = PeftModel.from_pretrained(_dequantized_reference(pm, ref), tmp_path, is_trainable=True)
    ref_loss, ref_grads = step(exact, b)
    assert ref_grads.keys() == grads.keys()
    assert abs(loss - ref_loss) <= EXACT_TOL * ref_loss
    for n, g in ref_grads.items():
        assert rel(grads[n], g) <= EXACT_TOL, (n, rel(grads[n], g))
    full = PeftModel.from_pretrained(copy.deepcopy(ref), tmp_path, is_trainable=True)
    ref_loss, ref_grads = step(full, b)
    assert abs(loss - ref_loss) <= NF4_LOSS_TOL * ref_loss
    got = torch.cat([grads[n].flatten() for n in ref_grads])
    want = torch.cat([g.flatten() for g in ref_grads.values()])
    assert rel(got, want) <= NF4_GRAD_TOL, rel(got, want)


def test_one_expert_is_dequantized_at_a_time() -> None:
    model = tiny("mixtral", hidden_size=128, intermediate_size=512)
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None, lora=False)
    experts = pm.model.layers[0].mlp.experts
    h = torch.randn(6, 128, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])  # every expert used
    w = torch.full((6, 2), 0.5, requires_grad=True)
    one_expert = 2 * 512 * 128 * 4  # gate_up of one expert, fp32: the largest dequantized copy
    with MemoryTracker("cpu") as mt:
        out = experts(h, idx, w)
        mt.mark("backward")
        out.sum().backward()
    # the 4 experts' gate_up alone are 4 x one_expert; activations here are a few KiB
    assert mt.peak_bytes < 1.5 * one_expert, (mt.peak_bytes, one_expert)
    assert h.grad is not None and w.grad is not None


def test_full_precision_experts_use_peft_as_is() -> None:
    pm = tightfit.prepare(tiny("mixtral"), quant=None, checkpoint=None, loss_chunks=None)
    wrappers = [m for m in pm.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrappers and all(type(m).__module__.startswith("peft.") for m in wrappers)
    _, grads = step(pm, batch())
    assert any(".experts.lora_A" in n for n in grads)


def test_checkpoint_plan_and_chunked_loss_give_the_same_step() -> None:
    b = batch()
    base = tiny("mixtral")
    plain = tightfit.prepare(copy.deepcopy(base), checkpoint=None, loss_chunks=None)
    stacked = tightfit.prepare(copy.deepcopy(base), checkpoint="every", loss_chunks=16)
    for n, p in plain.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    adapters = {n: p for n, p in plain.state_dict().items() if "lora_" in n}
    assert not stacked.load_state_dict(adapters, strict=False).unexpected_keys
    loss, grads = step(plain, b)
    loss2, grads2 = step(stacked, b)
    assert abs(loss - loss2) <= 1e-6 * loss
    for n, g in grads.items():
        assert rel(grads2[n], g) <= 1e-5, n


def test_bf16_compute_trains_fp32_adapters_as_the_fp32_run_does() -> None:
    base, b = tiny("mixtral"), batch()
    fp32 = tightfit.prepare(copy.deepcopy(base), checkpoint=None, loss_chunks=None)
    bf16 = tightfit.prepare(copy.deepcopy(base), checkpoint=None, loss_chunks=None,
                            compute_dtype="bfloat16")
    bf16.load_state_dict({n: p for n, p in fp32.state_dict().items() if "lora_" in n},
                         strict=False)
    assert all(p.dtype == torch.float32 for p in bf16.parameters() if p.requires_grad)
    experts = bf16.get_base_model().model.layers[0].mlp.experts.get_base_layer()
    assert expert_specs(experts)["down_proj"].dtype == torch.bfloat16  # dequantized as such
    loss, grads = step(fp32, b)
    loss16, grads16 = step(bf16, b)
    assert abs(loss16 - loss) <= 1e-2 * loss  # bf16 rounding (measured 3e-5)
    for n, g in grads.items():
        assert rel(grads16[n], g) <= 5e-2, n  # measured at most 1e-2


def test_notes_name_what_stays_in_full_precision_or_unadapted() -> None:
    pm = tightfit.prepare(tiny("mixtral"), checkpoint=None, loss_chunks=None)
    kept, bare = pm.tightfit_info.notes
    assert kept.startswith("not 4-bit") and "model.layers.*.mlp.gate.weight x2 (MoE router" in kept
    assert "lm_head.weight (output head)" in kept and "embed_tokens.weight (embeddings)" in kept
    assert "experts" not in kept and "self_attn" not in kept
    assert bare.startswith("no LoRA on") and "mlp.gate.weight" in bare and "experts" not in bare


def test_lora_dropout_on_4bit_experts_acts_on_each_experts_adapter_input() -> None:
    base = tiny("mixtral")
    kw = dict(checkpoint=None, loss_chunks=None)
    plain = tightfit.prepare(copy.deepcopy(base), lora={"r": 4}, **kw)
    dropped = tightfit.prepare(copy.deepcopy(base), lora={"r": 4, "dropout": 0.5}, **kw)
    for n, p in plain.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    dropped.load_state_dict({n: p for n, p in plain.state_dict().items() if "lora_" in n},
                            strict=False)
    wrappers = [m for m in dropped.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrappers and all(m.lora_dropout["default"].p == 0.5 for m in wrappers)
    b = batch()
    torch.manual_seed(3)
    train_loss, grads = step(dropped, b)
    torch.manual_seed(3)
    assert step(dropped, b)[0] == train_loss  # the mask is the RNG's: reproducible
    assert abs(train_loss - step(plain, b)[0]) > 1e-4  # and it drops something
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".experts." in n)
    dropped.eval()
    plain.eval()
    with torch.no_grad():
        assert abs(dropped(**b).loss.item() - plain(**b).loss.item()) <= 1e-6


def test_what_cannot_be_done_right_is_refused_before_any_change() -> None:
    model = tiny("mixtral")
    # peft's own wrapper (full-precision experts) has no adapter input to drop
    with pytest.raises(ValueError, match="dropout"):
        tightfit.prepare(model, quant=None, lora={"dropout": 0.1})
    assert all(p.requires_grad and p.is_floating_point() for p in model.parameters())
    assert not any(type(m).__name__ == "ParamWrapper" for m in model.modules())
    # adapters on attention only: the experts are quantized but not adapted, and say so
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None,
                          lora={"target_modules": "q_proj,v_proj"})
    assert not any(".experts" in t for t in pm.tightfit_info.adapted)
    assert "experts.gate_up_proj" in pm.tightfit_info.notes[1]

    from transformers import Llama4ForCausalLM, Llama4TextConfig  # experts outside the contract

    llama4 = Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_local_experts=2, max_position_embeddings=64))
    with pytest.raises(ValueError, match="Llama4TextExperts"):
        tightfit.prepare(llama4)
    assert all(p.requires_grad and p.is_floating_point() for p in llama4.parameters())
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in llama4.modules())


@pytest.mark.slow
def test_cli_trains_a_saved_mixtral(tmp_path, capsys) -> None:
    from tightfit.cli import main

    tiny("mixtral", vocab_size=256).save_pretrained(tmp_path / "mixtral")  # no tokenizer
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i}: the experts are routed in four bits" for i in range(64)))
    out = tmp_path / "run"
    rc = main(["train", "--model", str(tmp_path / "mixtral"), "--data", str(text), "--out",
               str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "16",
               "--device-budget", "none", "--threads", "1", "--tokenizer", "bytes"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "note: not 4-bit" in text and "MoE router" in text
    import json

    rows = {r["name"]: r for r in json.loads((out / "report.json").read_text())["pieces"]}
    assert rows["base weights"]["detail"]["expert_params"] == 2 * (4 * 256 * 64 + 4 * 64 * 128)
