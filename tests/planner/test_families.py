"""The planner's families: configs read as transformers reads them, parameters counted as
transformers builds them, and each family's memory model against a measured step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tightfit.planner.configs import hf_config, shape_from_config
from tightfit.planner.estimate import estimate
from tightfit.planner.presets import PRESETS
from tightfit.planner.shapes import FAMILIES, SLIDING, ModelShape
from tightfit.planner.table import PlanReport
from tightfit.planner.train_setup import TrainSetup
from tightfit.planner.verify import compare, relative_error

# One small preset per family (built on the meta device: no memory, no download).
_PRESET_OF = {"llama": "llama-3.2-1b", "mistral": "mistral-7b", "qwen2": "qwen2.5-0.5b",
              "qwen3": "qwen3-0.6b", "gemma": "gemma-2b", "gemma2": "gemma-2-2b",
              "gemma3": "gemma-3-1b", "phi3": "phi-3-mini-4k", "mixtral": "mixtral-8x7b",
              "qwen3_moe": "qwen3-30b-a3b"}

# Small configs of every family for measured steps (sliding windows shorter than the
# sequence, so that masked layers are measured too).
_SW, _FA = SLIDING, "full_attention"
SMALL = {
    "llama": ModelShape("llama", 128, 352, 3, 4, 2, 1000),
    "mistral": ModelShape("mistral", 128, 352, 3, 4, 2, 1000, family="mistral",
                          sliding_window=16),
    "qwen2": ModelShape("qwen2", 128, 352, 3, 4, 2, 1000, family="qwen2", tie_embeddings=True),
    "qwen3": ModelShape("qwen3", 128, 352, 3, 4, 2, 1000, family="qwen3", head_dim=48),
    "gemma": ModelShape("gemma", 128, 352, 3, 4, 1, 1000, family="gemma", head_dim=48,
                        tie_embeddings=True),
    "gemma2": ModelShape("gemma2", 128, 352, 3, 4, 2, 1000, family="gemma2", head_dim=48,
                         tie_embeddings=True, sliding_window=16, layer_types=(_SW, _FA, _SW),
                         attn_softcap=50.0, final_softcap=30.0),
    "gemma3": ModelShape("gemma3", 128, 352, 3, 4, 2, 1000, family="gemma3", head_dim=48,
                         tie_embeddings=True, sliding_window=16, layer_types=(_SW, _SW, _FA)),
    "phi3": ModelShape("phi3", 128, 352, 3, 4, 2, 1000, family="phi3", sliding_window=20),
    "mixtral": ModelShape("mixtral", 128, 256, 3, 4, 2, 1000, family="mixtral", experts=4,
                          experts_per_token=2),
    "qwen3_moe": ModelShape("qwen3_moe", 128, 96, 3, 4, 2, 1000, family="qwen3_moe",
                            head_dim=32, experts=8, experts_per_token=3),
}


def _hf_params(shape: ModelShape) -> dict[str, int]:
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, shape.traits.hf_class)(hf_config(shape))
    return {n: p.numel() for n, p in model.named_parameters()}


def test_every_family_has_a_preset_and_a_small_config() -> None:
    assert set(_PRESET_OF) == set(FAMILIES) == set(SMALL)
    assert {s.family for s in PRESETS.values()} == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameters_counted_as_transformers_builds_them(family: str) -> None:
    for shape in (PRESETS[_PRESET_OF[family]], SMALL[family]):
        params = _hf_params(shape)
        assert shape.num_params() == sum(params.values()), shape.name
        experts = sum(n for k, n in params.items() if ".experts." in k)
        assert experts == (0 if not shape.is_moe else
                           shape.layers * shape.experts * 3 * shape.hidden * shape.intermediate)
        if shape.is_moe:  # a token runs k of E experts
            k, e = shape.experts_per_token, shape.experts
            assert shape.active_params() == shape.num_params() - experts + experts * k // e
        else:
            assert shape.active_params() == shape.num_params()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_defaults_are_transformers(family: str) -> None:
    """A config.json with only the required keys reads as transformers' config class."""
    import transformers

    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    keys = {"hidden_size": 384, "intermediate_size": 512, "num_hidden_layers": 6,
            "num_attention_heads": 96, "vocab_size": 1000}
    shape = shape_from_config({"model_type": model_type, **keys})
    ref = transformers.AutoConfig.for_model(model_type, **keys)
    assert shape.max_positions == ref.max_position_embeddings
    assert shape.head_dim == (getattr(ref, "head_dim", None) or 384 // 96)
    assert shape.tie_embeddings == ref.tie_word_embeddings
    assert shape.kv_heads == (ref.num_key_value_heads or 96)
    window = getattr(ref, "sliding_window", None)
    if family.startswith("qwen"):
        window = window if getattr(ref, "use_sliding_window", False) else None
    if family in ("gemma2", "gemma3"):
        types = tuple(ref.layer_types)
        assert [shape.sliding(i) for i in range(6)] == [t == SLIDING for t in types]
        assert (shape.attn_softcap, shape.final_softcap) == (
            getattr(ref, "attn_logit_softcapping", None), ref.final_logit_softcapping)
    assert shape.sliding_window == window
    if shape.is_moe:
        experts = getattr(ref, "num_local_experts", None) or ref.num_experts
        assert (shape.experts, shape.experts_per_token) == (experts, ref.num_experts_per_tok)


def test_position_limits_are_the_models() -> None:
    limits = {"llama-2-7b": 4096, "llama-3.1-8b": 131072, "qwen3-8b": 40960,
              "gemma-2-9b": 8192, "gemma-3-27b": 131072, "phi-3-mini-128k": 131072,
              "mistral-nemo-12b": 1024000, "mixtral-8x22b": 65536}
    for name, limit in limits.items():
        assert PRESETS[name].max_positions == limit, name
    from tightfit.planner.ladder import plan

    report = plan("llama-3.1-8b", "80GiB", seq_len=32768)  # beyond the old 4,096 cap
    assert report.rows[0].setup.seq_len == 32768


def test_bad_family_configs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not modelled.*gemma2"):
        shape_from_config({"model_type": "gpt2", "hidden_size": 8})
    base = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises(ValueError, match="mlp_only_layers.*not modelled"):
        shape_from_config({"model_type": "qwen3_moe", **base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="needs num_experts >= num_experts_per_tok"):
        shape_from_config({"model_type": "mixtral", **base, "num_key_value_heads": 4,
                           "num_local_experts": 2,
                           "num_experts_per_tok": 3})
    with pytest.raises(ValueError, match="layer_types must name 2 layers"):
        shape_from_config({"model_type": "gemma2", **base, "layer_types": [SLIDING]})
    with pytest.raises(ValueError, match="a phi3 layer .* has no such projection.*qkv_proj"):
        estimate(SMALL["phi3"], TrainSetup(seq_len=16, lora_target_modules=("q_proj",)))


def _check_rows(report: PlanReport) -> None:
    """A row that does not apply to the family is marked so (and only the tiled ones, only
    where the MLP is not tiled), has no figures nor command, and is never recommended."""
    from tightfit.planner.estimate import untiled_mlp

    why = untiled_mlp(report.shape)
    tiled = {"QLoRA + every + offload + chunked + tiled MLP",
             "long-context stack (+ paged AdamW 8-bit)"}
    assert len(report.rows) == 11
    for row in report.rows:
        assert row.not_applicable == (why if row.name in tiled else None), row.name
        if row.not_applicable is not None:
            assert row.estimate is None and not row.fits and row.train_args == ()
            assert row is not report.recommended and not row.maximum
    text = str(report)
    assert (f"n/a: {why}" in text) == (why is not None)
    rows = json.loads(json.dumps(report.to_dict()))["rows"]
    assert [r["not_applicable"] for r in rows] == [r.not_applicable for r in report.rows]
    assert all(r["total_bytes"] is None for r in rows if r["not_applicable"])


def test_every_preset_plans() -> None:
    """Every preset answers, its tiled rows included: Phi-3's fused MLP and MoE experts
    tile since issue 26 (their rows were n/a; issue 28: 11 of the 50 presets used to fail
    with exit 2)."""
    import tightfit

    assert len(PRESETS) == 50
    marked = 0
    for name in PRESETS:
        report = tightfit.plan(name, "24GiB")
        _check_rows(report)
        marked += any(r.not_applicable for r in report.rows)
        longest = tightfit.plan(name, "24GiB", maximize="seq", granularity=4096)
        _check_rows(longest)
        assert longest.recommended is None or longest.recommended.maximum
    assert marked == 0
    assert estimate(SMALL["mixtral"], TrainSetup(seq_len=16, mlp_tile=8)).activation_peak > 0


@pytest.mark.parametrize("argv", [["--model", "mixtral-8x7b", "--gpu", "80GiB"],
                                  ["--model", "phi-3-mini-4k", "--gpu", "8GiB", "--max-seq"],
                                  ["--model", "qwen3-30b-a3b", "--json"]])
def test_cli_plans_the_families_it_cannot_tile(argv: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # (the name is issue 28's; since issue 26 these families tile)
    from tightfit.cli import main

    assert main(["plan", *argv]) in (0, 1)
    captured = capsys.readouterr()
    assert "not tiled" not in captured.out and "n/a" not in captured.out
    assert "tiled MLP" in captured.out and "Error" not in captured.err


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_local_config_of_every_family_plans(family: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The family's small config saved by transformers (a model folder's config.json)
    reads back as the same shape and plans, plain and with --max-seq."""
    from tightfit.cli import main

    shape = SMALL[family]
    hf_config(shape).to_json_file(str(tmp_path / "config.json"))
    assert shape_from_config(json.loads((tmp_path / "config.json").read_text()),
                             name=shape.name) == shape
    for extra in ([], ["--max-seq", "--granularity", "64"]):
        code = main(["plan", "--model", str(tmp_path), "--gpu", "16MiB", "--overhead", "0",
                     "--seq-len", "64", *extra])
        assert code in (0, 1), (family, extra)
        out = capsys.readouterr().out
        assert "n/a: " not in out  # every family tiles (issue 26)


def test_moe_counts_every_expert_once_in_storage_and_top_k_in_compute() -> None:
    from tightfit.planner.estimate import estimate, lora_param_count

    shape = SMALL["mixtral"]
    setup = TrainSetup(seq_len=16)
    n_lora, tensors = lora_param_count(shape, setup)
    r, h, i, e = setup.lora_r, shape.hidden, shape.intermediate, shape.experts
    attn = r * ((h + shape.q_size) * 2 + (h + shape.kv_size) * 2)
    assert n_lora == shape.layers * (attn + r * e * ((h + 2 * i) + (i + h)))
    assert tensors == shape.layers * 2 * 6  # q, k, v, o, gate_up, down: A and B each
    # the worst case: every token at one expert, so the backward moment grows with T
    from tightfit.planner.moe import expert_backward_bytes

    one = expert_backward_bytes(shape, setup)
    assert expert_backward_bytes(shape, setup.with_(seq_len=32)) - one == (
        16 * i * setup.d + 16 * (h + i) * setup.a)
    assert estimate(shape, setup).lora == n_lora * setup.lora_bytes


def test_gemma2_softcaps_cost_what_they_keep() -> None:
    from tightfit.planner.activations import head_loss_bytes
    from tightfit.planner.attention import attention_saved_bytes

    g2 = SMALL["gemma2"]
    plain = ModelShape("g2-no-cap", 128, 352, 3, 4, 2, 1000, family="gemma2", head_dim=48,
                       tie_embeddings=True, sliding_window=16, layer_types=(_SW, _FA, _SW))
    setup = TrainSetup(seq_len=64, compute_dtype="float32")
    t, v = setup.tokens, g2.vocab
    assert head_loss_bytes(g2, setup) - head_loss_bytes(plain, setup) == t * v * 4
    # eager attention keeps the scores: quadratic in the sequence
    scores = [attention_saved_bytes(g2, setup.with_(seq_len=n), 1)
              - attention_saved_bytes(plain, setup.with_(seq_len=n), 1) for n in (64, 128)]
    # the B·H·S² matrices (fp32: the capped scores and the softmax, 8 bytes a value)
    assert scores[1] - 2 * scores[0] == setup.batch_size * g2.heads * (128**2 - 2 * 64**2) * 8


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_memory_model_against_a_measured_step(family: str) -> None:
    """The QLoRA paper's recipe (NF4 + DQ, bf16 compute and adapters, paged 32-bit AdamW)
    on a small config of the family: the counted pieces (weights, constants, LoRA, grads,
    optimizer) within 1 % of the measured step; the activation and head + loss peaks never
    under-predicted by more than 2 % (what the margin covers) and over-predicted by at most
    15 % without checkpointing (Mixtral here: +11 %). With every layer recomputed, 10 %
    (measured: within +3 %; the MoE families, whose recomputed layer peaks at its last
    expert, Mixtral +0.4 %, Qwen3-MoE +0.8 %, were +26.5 % / +15.7 % before that moment was
    counted; docs/plan.md, "Families")."""
    shape = SMALL[family]
    setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, lora_dtype="bfloat16",
                       optimizer="paged_adamw", loss_chunk_tokens=16)
    res = compare(shape, setup, ("none", "every"))
    for piece, predicted, measured in res["none"]:
        if piece in ("activations", "logits_loss"):
            assert 0.98 * measured <= predicted <= 1.15 * measured, (piece, predicted, measured)
        else:
            assert relative_error(predicted, measured) <= 0.01, (piece, predicted, measured)
    (_, predicted, measured), = [r for r in res["every"] if r[0] == "activations"]
    assert 0.98 * measured <= predicted <= 1.10 * measured, (predicted, measured)


def test_moe_recomputed_expert_moments() -> None:
    """A recomputed MoE layer's last expert (every token at each of its k experts), by hand:
    in its forward, the layer's residual, normed input and output accumulator, its gathered
    input, its gate/up projection's base and adapter outputs and scaled copy (the previous
    expert's fp32 weighted output in 16-bit); in its backward, peft's full-size per-expert
    adapter gradient slices, which win with many experts and few tokens."""
    from tightfit.planner.moe import _pair_bytes, expert_moments

    setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, compute_dtype="bfloat16", quant="nf4",
                       lora_dtype="bfloat16")
    mix = SMALL["mixtral"]
    t, h, i, d, r, e = setup.tokens, mix.hidden, mix.intermediate, setup.d, setup.lora_r, mix.experts
    share = t * _pair_bytes(mix, setup)
    gate_up = t * h * 4 + 2 * t * 8 + t * h * d + t * r * d + 3 * t * 2 * i * d
    slices = e * r * d * (3 * i + 2 * h)
    assert expert_moments(mix, setup) == (
        3 * t * h * d - share + gate_up,
        -share + slices + 2 * t * i * d + 2 * t * h * d + t * 2 * 4 + 2 * i * h * d)
    forward, backward = expert_moments(_WIDE, setup.with_(**_FEW))
    assert backward > forward


_WIDE = ModelShape("q3m-E16", 128, 96, 2, 4, 2, 500, family="qwen3_moe", head_dim=32,
                   experts=16, experts_per_token=2)
_FEW = dict(seq_len=16, batch_size=1, loss_chunk_tokens=16)


@pytest.mark.slow
def test_moe_backward_moment_against_a_measured_step() -> None:
    """16 experts, 16 tokens: the last expert's backward (the adapters' gradient slices)
    is the recomputed layer's peak; within 10 % of the measured step, never 2 % under."""
    few = TrainSetup(lora_r=8, compute_dtype="bfloat16", quant="nf4", lora_dtype="bfloat16",
                     **_FEW)
    (_, predicted, measured), = [r for r in compare(_WIDE, few, ("every",))["every"]
                                 if r[0] == "activations"]
    assert 0.98 * measured <= predicted <= 1.10 * measured, (predicted, measured)  # -0.6 %


def test_recomputed_layer_backward_moments() -> None:
    """The moments of a recomputed layer's backward (NF4, bf16), counted by hand: the down
    projection's for Llama, the fused gate_up's for Phi-3 (twice the weight to dequantize,
    once the MLP's saved tensors are gone), the post-MLP norm's for Gemma 2."""
    from tightfit.planner.activations import (
        GEMMA_NORM_BWD,
        layer_backward_bytes,
        layer_saved_bytes,
        mlp_saved_bytes,
    )

    setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, compute_dtype="bfloat16", quant="nf4",
                       lora_dtype="bfloat16")
    t, d, r = setup.tokens, setup.d, setup.lora_r
    llama = SMALL["llama"]
    h, i = llama.hidden, llama.intermediate
    # down: the adapter's kept input (T·i·d) and hidden (T·r·d) freed; its input gradient
    # (T·i·d) beside the weight dequantized to fp32 and cast (i·h·6)
    down = -(t * i * d + t * r * d) + t * i * d + i * h * 6
    assert layer_backward_bytes(llama, setup, 1) - layer_saved_bytes(llama, setup, layer=1) == down
    phi3 = SMALL["phi3"]
    gate_up = (-mlp_saved_bytes(phi3, setup, t) + 2 * t * i * d + t * h * d
               + 2 * i * h * 6)
    assert layer_backward_bytes(phi3, setup, 1) - layer_saved_bytes(phi3, setup, layer=1) == gate_up
    g2 = SMALL["gemma2"]
    norm = GEMMA_NORM_BWD * t * g2.hidden * 4
    assert layer_backward_bytes(g2, setup, 1) - layer_saved_bytes(g2, setup, layer=1) >= norm


def test_fp32_adapters_in_bf16_recompute_moment() -> None:
    """fp32 adapters, bf16 compute (NF4): the recompute's last op holds, beside all the
    layer saved, the down projection's output, its adapter's two fp32 outputs and the
    residual, the MLP's input and the gated product (the adapters saved fp32 copies of
    them), and the down adapter's output gradient cast and scaled (T·h·(d + a))."""
    from tightfit.planner.activations import layer_backward_bytes, layer_saved_bytes

    setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, compute_dtype="bfloat16", quant="nf4",
                       lora_dtype="float32", lora_compute="lora_dtype")
    mistral = _MISTRAL  # narrow enough that this moment is the layer's peak
    t, h, i, d, a = setup.tokens, mistral.hidden, mistral.intermediate, setup.d, setup.a
    last = t * h * (2 * d + 2 * a) + t * h * d + t * i * d + t * h * (d + a)
    assert (layer_backward_bytes(mistral, setup, 1)
            - layer_saved_bytes(mistral, setup, layer=1)) == last


_MISTRAL = ModelShape("mistral-h96-L3-w24", 96, 256, 3, 3, 1, 1536, family="mistral",
                      sliding_window=24)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    ModelShape("phi3-h192-L3-w40", 192, 448, 3, 6, 2, 1300, family="phi3", sliding_window=40),
    _MISTRAL,
])
def test_fp32_adapters_in_bf16_every_against_a_measured_step(shape: ModelShape) -> None:
    """Every layer recomputed, peft's fp32 adapters on a bf16 NF4 base: within 10 %, never
    2 % under (measured: Phi-3 +6.6 %, Mistral −0.0 %; the calibrated transients gave
    +12.9 % / +5.2 %)."""
    setup = TrainSetup(seq_len=48, batch_size=2, lora_r=8, compute_dtype="bfloat16", quant="nf4",
                       loss_chunk_tokens=32, lora_compute="lora_dtype")
    (_, predicted, measured), = [r for r in compare(shape, setup, ("every",))["every"]
                                 if r[0] == "activations"]
    assert 0.98 * measured <= predicted <= 1.10 * measured, (predicted, measured)
