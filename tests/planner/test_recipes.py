"""Recipes the planner can state (adapter and optimizer-state dtypes, paged 32-bit AdamW),
the safety margin and its "tight" rows, the exit code, and train's option names in plan."""

from __future__ import annotations

import json

import pytest

from tightfit.cli import build_parser, main
from tightfit.planner.estimate import estimate, lora_param_count, optimizer_state_bytes
from tightfit.planner.ladder import DEFAULT_MARGIN, plan
from tightfit.planner.presets import PRESETS
from tightfit.planner.train_setup import TrainSetup

# The QLoRA paper's LLaMA-65B recipe (Dettmers et al. 2023, qlora.py / scripts): NF4 + DQ,
# bf16 compute, LoRA r=64 on every linear with dropout 0.05, adapters cast to bf16, every
# layer checkpointed, paged_adamw_32bit, batch 1.
PAPER = dict(seq_len=512, lora_r=64, lora_dropout=0.05, lora_dtype="bfloat16")


def test_adapter_and_state_dtypes() -> None:
    shape = PRESETS["llama-2-7b"]
    fp32 = TrainSetup(seq_len=512)
    bf16 = fp32.with_(lora_dtype="bf16")
    paged = bf16.with_(optimizer="paged_adamw")
    n, tensors = lora_param_count(shape, fp32)
    assert estimate(shape, bf16).lora * 2 == estimate(shape, fp32).lora == 4 * n
    # torch's AdamW keeps its state in the adapters' dtype; the paged 32-bit AdamW in fp32
    assert optimizer_state_bytes(shape, bf16) == 2 * 2 * n + 4 * tensors
    assert optimizer_state_bytes(shape, paged) == 2 * 4 * n + 4 * tensors
    assert (bf16.state_dtype, paged.state_dtype) == ("bfloat16", "float32")
    assert TrainSetup(lora_dtype="bf16", optimizer="paged_adamw",
                      optimizer_state_dtype="fp32").optimizer_state_dtype == "float32"
    with pytest.raises(ValueError, match="keeps its state in the adapters' dtype .*"
                                         "choose optimizer='paged_adamw'"):
        TrainSetup(lora_dtype="bf16", optimizer="adamw", optimizer_state_dtype="float32")
    with pytest.raises(ValueError, match="'paged_adamw8bit' keeps 8-bit state"):
        TrainSetup(optimizer="paged_adamw8bit", optimizer_state_dtype="float32")


def test_qlora_paper_recipe_fits_65b_in_48gb() -> None:
    report = plan("llama-65b", "48GB", **PAPER)
    row = next(r for r in report.rows if r.name == "QLoRA + ckpt every + paged AdamW 32-bit")
    s = row.setup
    assert (s.quant, s.double_quant, s.lora_dtype, s.optimizer, s.checkpoint) == (
        "nf4", True, "bfloat16", "paged_adamw", "every")
    assert row.fits and row.estimate.total <= report.gpu_bytes - report.margin_bytes
    assert report.recommended is not None
    # the same row with peft's fp32 adapters needs more
    fp32 = plan("llama-65b", "48GB", **{**PAPER, "lora_dtype": "float32"})
    same = next(r for r in fp32.rows if r.name == row.name)
    assert same.estimate.lora == 2 * row.estimate.lora


def test_rows_inside_the_margin_are_tight_and_never_recommended() -> None:
    shape = PRESETS["llama-2-7b"]
    free = plan(shape, "24GiB", seq_len=2048, margin=0)
    qlora = next(r for r in free.rows if r.name == "NF4+DQ LoRA (QLoRA)")
    # a device on which that row fits with 1 % to spare: inside a 6 % margin
    gpu = int(qlora.estimate.total / 0.99)
    report = plan(shape, gpu, seq_len=2048)
    row = next(r for r in report.rows if r.name == qlora.name)
    assert report.margin_bytes == pytest.approx(DEFAULT_MARGIN * gpu, abs=1)
    assert row.tight and row.fits_device and not row.fits and report.recommended is not row
    text = str(report)
    assert "tight" in text and f"margin: {100 * DEFAULT_MARGIN:g}% of the device" in text
    assert plan(shape, gpu, seq_len=2048, margin=0).rows[3].fits
    with pytest.raises(ValueError, match="margin must be a share of the device"):
        plan(shape, gpu, margin=0.7)


def test_nothing_fits_exits_1_with_the_smallest_total(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-2-70b", "--gpu", "8GiB", "--seq-len", "4096"]) == 1
    out = capsys.readouterr().out
    smallest = min(plan("llama-2-70b", "8GiB", seq_len=4096).rows, key=lambda r: r.estimate.total)
    assert "nothing fits" in out and "recommended:" not in out
    from tightfit.measure.sizes import format_bytes

    assert f"needs {format_bytes(smallest.estimate.total)}" in out
    assert main(["plan", "--model", "llama-2-70b", "--gpu", "8GiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["recommended"] is None


def test_plan_speaks_train_names_only(capsys: pytest.CaptureFixture[str]) -> None:
    new = ["plan", "--model", "qwen3-8b", "--batch-size", "2", "--compute-dtype", "bf16",
           "--lora-target-modules", "q_proj,v_proj"]
    a = build_parser("plan").parse_args(new)
    assert (a.batch_size, a.compute_dtype, a.lora_target_modules) == (2, "bf16", "q_proj,v_proj")
    # plan's former spellings are gone (nothing was released with them), and no abbreviation
    # lets the old --batch pass as --batch-size, in plan or in train
    for command, old in (("plan", ["--lora-targets", "q_proj"]), ("plan", ["--dtype", "bf16"]),
                         ("plan", ["--batch", "2"]), ("train", ["--batch", "2"])):
        model = ["--model", "qwen3-8b"] if command == "plan" else []
        with pytest.raises(SystemExit) as exit_:
            build_parser(command).parse_args([command, *model, *old])
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {old[0]}" in capsys.readouterr().err
    for old_kw in ("batch", "lora_targets"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old_kw}'"):
            plan("qwen3-8b", "24GiB", **{old_kw: 2})
    for old_field in ("batch", "lora_targets", "adapter_dtype"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old_field}'"):
            TrainSetup(**{old_field: 2})  # type: ignore[arg-type]


def test_one_spelling_of_none_and_of_dtypes_in_train() -> None:
    from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
    from tightfit.train.train_command import config_from_args

    assert PrepareOptions(loss_chunks="none").loss_chunks is None
    assert LoraOptions(dtype="bf16").dtype == "bfloat16"
    cfg = config_from_args(build_parser("train").parse_args(
        ["train", "--compute-dtype", "bf16", "--lora-dtype", "fp16"]))
    assert (cfg.prepare.compute_dtype, cfg.lora.dtype) == ("bfloat16", "float16")
