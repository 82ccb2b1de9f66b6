"""tightfit.plan / ``tightfit plan``: the configuration ladder, the recommendation, bad input."""

from __future__ import annotations

import json

import pytest

import tightfit
from tightfit.cli import main
from tightfit.measure.sizes import format_bytes, parse_bytes
from tightfit.planner.estimate import Overhead, estimate
from tightfit.planner.ladder import plan
from tightfit.planner.presets import PRESETS, load_shape
from tightfit.planner.train_setup import TrainSetup


def test_parse_bytes() -> None:
    assert parse_bytes("24GiB") == 24 * 1024**3
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    assert parse_bytes(4096) == 4096
    assert format_bytes(24 * 1024**3) == "24.0 GiB"
    for bad in ("-3GB", "0", "abc", "12 parsecs", "nan GB", "inf"):
        with pytest.raises(ValueError, match="size|unit"):
            parse_bytes(bad)


def test_presets_are_published_sizes() -> None:
    # parameter counts as published (billions)
    expected = {"llama-2-7b": 6.74, "llama-2-70b": 68.98, "llama-3-8b": 8.03,
                "mistral-7b": 7.24, "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.71,
                "qwen2.5-0.5b": 0.49}
    for name, billions in expected.items():
        assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, abs=0.01), name


def test_config_json(tmp_path) -> None:  # noqa: ANN001
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "vocab_size": 3000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_shape(tmp_path)
    assert (shape.hidden, shape.kv_heads, shape.head_dim, shape.tie_embeddings) == (256, 2, 32, True)


def test_bad_models(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="known presets: llama-7b"):
        load_shape("llama-9b")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_shape(tmp_path / "broken.json")
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="missing intermediate_size"):
        load_shape(tmp_path / "partial.json")
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ValueError, match="not modelled"):
        load_shape(tmp_path / "gpt2.json")
    (tmp_path / "heads.json").write_text(json.dumps(
        {"hidden_size": 10, "intermediate_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 3, "vocab_size": 5}))
    with pytest.raises(ValueError, match="not divisible"):
        load_shape(tmp_path / "heads.json")
    with pytest.raises(FileNotFoundError):
        load_shape(tmp_path / "missing.json")


def test_seven_b_on_24gib() -> None:
    report = tightfit.plan("llama-2-7b", "24GiB", seq_len=2048, batch_size=1)
    rows = {r.name: r for r in report.rows}
    bf16, qlora = rows["bf16 LoRA"], rows["NF4+DQ LoRA (QLoRA)"]
    # 7B in bf16 is 12.6 GiB of weights; NF4 is a quarter of the linears
    assert bf16.estimate.weights == pytest.approx(6.74e9 * 2, rel=0.01)
    assert qlora.estimate.weights < 0.3 * bf16.estimate.weights
    assert qlora.estimate.constants < rows["NF4 LoRA"].estimate.constants / 3
    room = report.gpu_bytes - report.margin_bytes
    assert report.margin_bytes > 0
    for r in report.rows:
        assert r.fits == (r.estimate.total <= room)  # the margin stays free
        assert r.tight == (room < r.estimate.total <= report.gpu_bytes)
    assert not bf16.fits and rows["QLoRA + ckpt every"].fits
    rec = report.recommended
    assert rec is not None and rec.fits
    assert rec.slowdown == min(r.slowdown for r in report.rows if r.fits)
    text = str(report)
    assert "recommended:" in text and "tightfit train" in text and "--quant nf4" in text


def test_recommendation_follows_the_gpu() -> None:
    big = plan("llama-2-7b", "80GiB", seq_len=2048)
    assert big.recommended is not None and big.recommended.name == "bf16 LoRA"
    long = plan("llama-3-8b", "24GiB", seq_len=8192)
    assert long.recommended is not None and long.recommended.setup.checkpoint != "none"
    tiny = plan("llama-2-70b", "8GiB", seq_len=4096)
    assert tiny.recommended is None and "nothing fits" in str(tiny)


def test_budget_row_uses_the_room_left() -> None:
    report = plan("llama-3-8b", "24GiB", seq_len=4096, batch_size=2)
    row = next(r for r in report.rows if r.setup.checkpoint == "budget")
    assert row.fits
    e = row.estimate
    assert e.activation_peak <= row.setup.checkpoint_budget
    every = estimate(report.shape, row.setup.with_(checkpoint="every"), Overhead())
    assert e.recompute_fraction <= every.recompute_fraction


def test_cli_json_and_errors(capsys) -> None:  # noqa: ANN001
    assert main(["plan", "--model", "mistral-7b", "--gpu", "24GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["kv_heads"] == 8 and len(out["rows"]) == 11
    assert out["recommended"] in {r["name"] for r in out["rows"]}
    row = out["rows"][0]
    assert row["total_bytes"] == sum(row["pieces_bytes"].values())
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "-3GB"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "24"]) == 2
    assert "write the unit" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-5"]) == 2
    assert "known presets" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-2-7b", "--seq-len", "9000"]) == 2
    assert "max_position_embeddings=4096" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-2-7b", "--verify"]) == 2
    assert "small config" in capsys.readouterr().err


def test_train_setup_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="quant"):
        TrainSetup(quant="nf3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint policy"):
        TrainSetup(checkpoint="half")
    with pytest.raises(ValueError, match="lora_target_modules"):
        TrainSetup(lora_target_modules=("c_attn",))


@pytest.mark.slow
def test_cli_verify_small_config(tmp_path, capsys) -> None:  # noqa: ANN001
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 256, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--model", str(tmp_path), "--gpu", "64MiB", "--overhead", "0",
            "--seq-len", "16", "--batch-size", "2", "--lora-r", "4", "--margin", "0",
            "--verify", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [v["name"] for v in out["verify"]] == [r["name"] for r in out["rows"]]
    for entry in out["verify"]:
        for piece, predicted, measured in entry["pieces"]:
            assert abs(predicted - measured) <= 0.10 * measured, (entry["name"], piece)


def test_train_args_parse_as_tightfit_train_options() -> None:
    from tightfit.cli import build_parser
    from tightfit.train.train_command import config_from_args

    report = plan("llama-3-8b", "24GiB", seq_len=4096, batch_size=2)
    for row in report.rows:
        args = build_parser().parse_args(["train", *row.train_args])
        cfg = config_from_args(args)
        s = row.setup
        assert (cfg.train.seq_len, cfg.train.batch_size, cfg.lora.r) == (
            s.seq_len, s.batch_size, s.lora_r)
        assert cfg.prepare.quant == ("nf4" if s.quant == "nf4" else None)
        assert (cfg.prepare.checkpoint or "none") == s.checkpoint
        if s.checkpoint == "budget":  # a readable size, rounded down (by < 1 % of its unit)
            assert s.checkpoint_budget - 2**30 // 100 < cfg.prepare.checkpoint_budget \
                <= s.checkpoint_budget
        else:
            assert cfg.prepare.checkpoint_budget is None
        if s.paged:  # whole pages: exact
            assert cfg.optimizer.device_budget == s.optimizer_device_budget
        assert cfg.prepare.loss_chunks == s.loss_chunk_tokens
        assert cfg.optimizer.kind == s.optimizer
        assert (cfg.lora.dtype, cfg.lora.dropout) == (s.lora_dtype, s.lora_dropout)


def test_the_recommended_command_reads_as_typed(tmp_path) -> None:  # noqa: ANN001
    from tightfit.planner.train_args import size_arg

    report = plan("llama-3-8b", "24GiB", seq_len=4096, batch_size=2, host_ram="64GiB")
    rec = report.recommended
    assert rec is not None and rec.setup.checkpoint == "budget"
    budget = size_arg(rec.setup.checkpoint_budget)
    assert budget.endswith("GiB") and parse_bytes(budget) <= rec.setup.checkpoint_budget
    command = next(line for line in str(report).splitlines() if "tightfit train" in line)
    assert f"--checkpoint-budget {budget} " in command and "--model DIR " in command  # a preset
    assert size_arg(15924214945) == "14.83GiB" and size_arg(3 * 8 * 2**20) == "24MiB"
    # a folder (or its config.json) is what train takes: printed as given, quoted
    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}))
    for given in (folder, folder / "config.json", f"{folder}/"):
        report = plan(given, "1GiB", seq_len=64, overhead=0)
        assert str(report.to_dict()["model_dir"]).rstrip("/") == str(folder), given
        assert f"tightfit train --model '{folder}" in str(report), given
