"""prepare(): NF4 + DQ layers from bitsandbytes, LoRA from peft, errors before any change."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions


def tiny(hidden: int = 64, layers: int = 2, vocab: int = 128) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def test_linears_become_nf4_with_double_quant_and_lora_on_each() -> None:
    model = tiny()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n != "lm_head"}
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None, lora={"r": 4, "alpha": 8})
    info = pm.tightfit_info
    assert sorted(info.quantized) == sorted(originals)
    layers = dict((n, m) for n, m in pm.named_modules() if isinstance(m, bnb.nn.Linear4bit))
    assert len(layers) == len(originals)
    for name, layer in layers.items():
        qs = layer.weight.quant_state
        assert qs.quant_type == "nf4" and qs.nested and qs.blocksize == 64
        # the packed weights hold the original values to NF4 precision
        orig = originals[name.removeprefix("base_model.model.").removesuffix(".base_layer")]
        deq = bnbF.dequantize_4bit(layer.weight.data, qs)
        assert deq.shape == orig.shape
        rel = (deq - orig).norm() / orig.norm()
        assert rel < 0.15
    # output head stays a plain linear in full precision, frozen
    head = pm.get_output_embeddings()
    assert type(head) is nn.Linear and not head.weight.requires_grad
    # only the LoRA matrices train: r * (in + out) per adapted layer
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    expected = sum(4 * (m.in_features + m.out_features) for m in layers.values())
    assert sum(p.numel() for p in trainable.values()) == expected


def test_prepared_model_trains_on_cpu() -> None:
    pm = tightfit.prepare(tiny(), checkpoint="every", loss_chunks=16)
    opt = tightfit.optimizer_for(pm, kind="adamw", lr=1e-2)
    x = torch.randint(0, 128, (2, 32))
    losses = []
    for _ in range(5):
        loss = pm(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_no_double_quant_keeps_fp32_absmax() -> None:
    pm = tightfit.prepare(tiny(), double_quant=False, checkpoint=None, loss_chunks=None)
    qs = next(m for m in pm.modules() if isinstance(m, bnb.nn.Linear4bit)).weight.quant_state
    assert not qs.nested and qs.absmax.dtype == torch.float32


def test_lora_targets_that_match_nothing_fail_before_any_change() -> None:
    model = tiny()
    with pytest.raises(ValueError, match="match no linear layer"):
        tightfit.prepare(model, lora={"target_modules": ["nonexistent_proj"]})
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_bad_options_name_the_fix() -> None:
    with pytest.raises(ValueError, match="quant"):
        PrepareOptions(quant="int3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="valid keys"):
        LoraOptions.coerce({"rank": 8})
    with pytest.raises(ValueError, match="policy|Policy"):
        tightfit.prepare(tiny(), checkpoint="sometimes")


def test_budget_below_the_plans_minimum_is_refused_before_training() -> None:
    x = torch.randint(0, 128, (2, 32))
    with pytest.raises(ValueError):
        tightfit.prepare(tiny(), checkpoint="budget", checkpoint_budget=1,
                         example={"input_ids": x, "labels": x})


def test_model_folder_errors_and_loading(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tightfit.prepare(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json"):
        tightfit.prepare(tmp_path)
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=64).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="not a causal language model"):
        tightfit.prepare(tmp_path / "vit")
    tiny().save_pretrained(tmp_path / "llama")
    pm = tightfit.prepare(tmp_path / "llama", checkpoint=None)
    assert pm.tightfit_info.quantized


def test_optimizer_for_builds_over_trainable_params_only() -> None:
    from tightfit.optim.adamw import PagedAdamW

    pm = tightfit.prepare(tiny(), checkpoint=None, loss_chunks=None)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    opt = tightfit.optimizer_for(pm)
    assert isinstance(opt, PagedAdamW)
    assert [p for g in opt.param_groups for p in g["params"]] == trainable
    opt.close()
    ref = tightfit.optimizer_for(pm, kind="adamw")
    assert type(ref) is torch.optim.AdamW
    with pytest.raises(ValueError, match="unknown optimizer"):
        tightfit.optimizer_for(pm, kind="adagrad")  # type: ignore[arg-type]
    frozen = tiny()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        tightfit.optimizer_for(frozen)


@pytest.mark.parametrize(
    ("kind", "betas"),
    [("paged_adamw8bit", (0.9, 0.999)), ("paged_lion", (0.9, 0.99)), ("paged_lion8bit", (0.9, 0.99))],
)
def test_optimizer_for_kinds_and_default_betas(kind: str, betas: tuple[float, float]) -> None:
    pm = tightfit.prepare(tiny(), checkpoint=None, loss_chunks=None)
    with tightfit.optimizer_for(pm, kind=kind) as opt:
        assert type(opt).__name__.lower() == kind.replace("_", "")
        assert opt.param_groups[0]["betas"] == betas
    sgd = tightfit.optimizer_for(pm, kind="paged_sgd", momentum=0.9)
    assert sgd.param_groups[0]["momentum"] == 0.9
    sgd.close()


@pytest.mark.cuda
def test_prepare_quantizes_and_trains_on_cuda() -> None:
    from tightfit.report.report import measure_report

    x = torch.randint(0, 128, (2, 32), device="cuda")
    batch = {"input_ids": x, "labels": x}
    pm = tightfit.prepare(tiny(), device="cuda", example=batch)
    info = pm.tightfit_info
    assert info.compute_dtype == torch.bfloat16 and info.plan is not None
    layer = next(m for m in pm.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert layer.weight.device.type == "cuda" and layer.weight.quant_state.nested
    opt = tightfit.optimizer_for(pm, lr=1e-2)
    losses = []
    for _ in range(5):
        loss = pm(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    report = measure_report(pm, batch, optimizer=opt)
    assert report.piece("activations").with_bytes > 0
    opt.close()


def test_gpt2_conv1d_layers_are_quantized_and_adapted() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128,
                                       n_positions=64, bos_token_id=0, eos_token_id=0))
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules()
                 if isinstance(m, Conv1D)}
    pm = tightfit.prepare(model, checkpoint=None, loss_chunks=None)
    assert not any(isinstance(m, Conv1D) for m in pm.modules())
    assert sorted(pm.tightfit_info.quantized) == sorted(originals)
    for name, layer in pm.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            w = originals[name.removeprefix("base_model.model.").removesuffix(".base_layer")]
            deq = bnbF.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
            assert deq.shape == w.t().shape  # Conv1D stores [in, out]; Linear [out, in]
            assert (deq - w.t()).norm() / w.norm() < 0.15
    x = torch.randint(0, 128, (2, 32))
    assert torch.isfinite(pm(input_ids=x, labels=x).loss)


def test_gemma2_prepares_with_defaults_and_its_loss_is_soft_capped() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tightfit.loss import is_chunked_loss_enabled

    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        final_logit_softcapping=0.5, attn_implementation="eager"))
    x = torch.randint(0, 128, (2, 32))
    batch = {"input_ids": x, "labels": x}
    pm = tightfit.prepare(model, example=batch)  # every default: chunked loss included
    assert is_chunked_loss_enabled(pm) and pm.tightfit_info.loss_chunks == "auto"
    loss = pm(**batch).loss
    # the soft-capped logits' loss, as HF's own forward computes it
    with torch.no_grad(), pm.disable_adapter():
        ref = pm.get_base_model().__class__.forward(pm.get_base_model(), **batch).loss
        chunked = pm(**batch).loss
    assert abs(chunked.item() - ref.item()) <= 1e-6 * ref.item()
    loss.backward()
    assert all(p.grad is not None for p in pm.parameters() if p.requires_grad)


@pytest.mark.parametrize("hidden", [32, 64])
def test_an_eval_forward_leaves_the_4bit_layers_as_training_sees_them(hidden: int) -> None:
    # bitsandbytes 0.50 repacks a Linear4bit for its AVX512-BF16 CPU kernel at a no-grad
    # forward (bf16 absmax, kept for every later step; rows under a block fail): prepare keeps
    # its layers on the one kernel, so an eval between steps changes nothing
    torch.manual_seed(0)
    model = tightfit.prepare(tiny(hidden), checkpoint=None, loss_chunks=None, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    before = [(m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for m in layers]
    x = torch.randint(0, 128, (2, 16))
    model.train()
    with torch.no_grad():
        train_logits = model(input_ids=x).logits
    model.eval()
    with torch.no_grad():
        eval_logits = model(input_ids=x).logits
    model.train()
    for m, (w, absmax) in zip(layers, before, strict=True):
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
        assert torch.equal(m.weight.data, w) and torch.equal(m.weight.quant_state.absmax, absmax)
    assert torch.equal(eval_logits, train_logits)  # LoRA dropout is 0: one function
