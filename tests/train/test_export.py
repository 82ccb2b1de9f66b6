"""``tightfit export``: the adapter as trained, and a merged HF folder that transformers loads
alone, whose held-out loss equals the adapter model's (bf16: within its rounding; fp32: to
1e-5, which merging into the original instead of the dequantized weights misses by 5e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from tightfit.cli import main


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.float().item()


def test_export_merged_model_loads_in_transformers_with_the_adapters_loss(tmp_path, tiny_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import tightfit

    run = tmp_path / "run"
    text = tmp_path / "train.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 200)
    assert main(["train", "--model", str(tiny_dir), "--data", str(text), "--out", str(run),
                 "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--lr", "2e-2",
                 "--checkpoint", "none", "--track-every", "0", "--lora-r", "4"]) == 0
    assert main(["export", str(run), "--merge"]) == 0
    assert main(["export", str(run), "--merge", "--dtype", "float32",
                 "--out", str(tmp_path / "fp32")]) == 0
    assert (run / "export" / "adapter" / "adapter_config.json").is_file()
    assert json.loads((run / "export" / "merged" / "config.json").read_text())["use_cache"]

    held_out = torch.tensor([list(b"class Point:\n    def norm(self):\n        return 0\n")])
    # the adapter model: the run's 4-bit base (as trained) with the adapter, through peft
    base = tightfit.prepare(str(tiny_dir), lora=False, checkpoint=None, loss_chunks=None,
                            device="cpu")
    adapted = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    expected = _loss(adapted, held_out)
    merged = AutoModelForCausalLM.from_pretrained(run / "export" / "merged").eval()
    assert merged.dtype == torch.bfloat16
    assert _loss(merged, held_out) == pytest.approx(expected, rel=1e-2)  # bf16 weights
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32" / "merged").eval()
    assert _loss(exact, held_out) == pytest.approx(expected, abs=1e-5)
    original = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    plain = PeftModel.from_pretrained(original, str(run / "adapter")).merge_and_unload()
    assert abs(_loss(plain, held_out) - expected) > 1e-4  # the NF4 round trip matters
    with adapted.disable_adapter():  # and the adapter moved the loss
        assert abs(_loss(adapted, held_out) - expected) > 1e-2
    generated = merged.generate(held_out[:, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)
    before = sorted(p.stat().st_mtime_ns for p in (run / "export").rglob("*"))
    assert main(["export", str(run)]) == 2  # the folder exists: nothing is replaced
    assert before == sorted(p.stat().st_mtime_ns for p in (run / "export").rglob("*"))


def test_export_refuses_a_folder_that_is_no_run(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # one message (wrapped at 100 columns)
    assert "not a tightfit train output folder" in err
    # the hint says what export takes, not --resume (issue 28 item 6)
    assert "pass tightfit export the --out folder of a tightfit train run" in err
    assert "--resume" not in err and err.count("tightfit export:") == 1
    assert main(["export", str(tmp_path / "notarun")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{str(tmp_path / 'notarun')!r} does not exist" in err


def test_merge_refuses_4bit_moe_experts_before_writing(tmp_path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from tightfit.train.export import merged_model
    from tightfit.train.run_options import RunConfig, TrainOptions

    folder = tmp_path / "moe"
    MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=32)).save_pretrained(folder)  # fmt: skip
    cfg = RunConfig(train=TrainOptions(model=str(folder)))
    with pytest.raises(ValueError, match="dequantizes 4-bit linear layers only; this run also "
                                         "quantized"):
        merged_model(cfg, tmp_path / "adapter", torch.float32)
