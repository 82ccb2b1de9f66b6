"""tightfit train end to end: loss falls, resume is bit-exact (from the folder alone too),
saves are atomic, bad input fails before anything is written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tightfit.cli import main
from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.qlora.prepare_options import LoraOptions
from tightfit.train import resume
from tightfit.train.data import Batcher
from tightfit.train.loop import RunConfig, TrainOptions, train
from tightfit.train.run_options import DataOptions
from tightfit.train.run_setup import DEMO_DEVICE_BUDGET


def _cfg(out: Path, model: Path | None, **train_kw) -> RunConfig:
    kw = {"batch_size": 2, "seq_len": 32, "steps": 4, "save_every": 2, "track_every": 2}
    kw.update(train_kw)
    return RunConfig(
        train=TrainOptions(model=None if model is None else str(model), out=str(out), **kw),
        lora=LoraOptions(r=4, alpha=8, dropout=0.1),  # dropout: resume must restore the RNG
        optimizer=OptimizerOptions(lr=1e-2),
    )


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_default_run_finishes_loss_falls_and_writes_everything(tmp_path) -> None:
    # 8 steps only: a higher lr than the recipe's 2e-4 makes the fall visible this soon
    cfg = RunConfig(train=TrainOptions(out=str(tmp_path / "run"), steps=8, batch_size=4,
                                       seq_len=64, save_every=4, track_every=4),
                    optimizer=OptimizerOptions(lr=2e-3))
    logs: list[str] = []
    result = train(cfg, progress=False, log=logs.append)
    assert any("RANDOM weights" in line for line in logs)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1
    out = result.out
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "report.json", "report.md", "memory_report.png", "memory_timeline.png",
                 "loss_curve.png", "run_config.json", "LATEST"):
        assert (out / name).is_file(), name
    latest = resume.latest_state(out)
    assert latest is not None and latest.name == "step-00000008"
    assert (latest / "optimizer.pt").is_file()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000008"]
    report = json.loads((out / "report.json").read_text())
    names = [p["name"] for p in report["pieces"]]
    assert names == ["base weights", "quantization constants", "trainable params + grads",
                     "activations", "optimizer state"]
    peaks = [h["activation_peak"] for h in result.history if h["activation_peak"] is not None]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    # measured beside tightfit plan's prediction of the same setup: the counted pieces agree,
    # and the optimizer's device share is the budget the run paged under (the demo's own)
    predicted = {r["piece"]: r for r in report["predicted"]}
    for piece in ("LoRA params", "LoRA grads", "optimizer state on the device"):
        assert predicted[piece]["predicted"] == predicted[piece]["measured"], piece
    state = predicted["optimizer state"]  # the planner also counts each param's step counter
    assert abs(state["predicted"] - state["measured"]) <= 0.001 * state["measured"]
    assert predicted["optimizer state on the device"]["measured"] == DEMO_DEVICE_BUDGET


def test_stop_at_k_and_resume_equals_uninterrupted_bit_for_bit(tmp_path, tiny_dir) -> None:
    full = train(_cfg(tmp_path / "full", tiny_dir, steps=6), progress=False, log=lambda s: None)
    part = _cfg(tmp_path / "part", tiny_dir, steps=3)
    train(part, progress=False, log=lambda s: None)
    resumed = train(replace(part, train=replace(part.train, steps=6, resume=str(tmp_path / "part"))),
                    progress=False, log=lambda s: None)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    a, b = _adapter(full.out), _adapter(resumed.out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the optimizer state files (the paged optimizer's streamed format) are identical too
    fa = (resume.latest_state(full.out) / "optimizer.pt").read_bytes()
    fb = (resume.latest_state(resumed.out) / "optimizer.pt").read_bytes()
    assert fa == fb


def test_a_failed_save_leaves_the_previous_saved_state(tmp_path, tiny_dir, monkeypatch) -> None:
    out = tmp_path / "run"
    real = resume.save_optimizer
    calls = {"n": 0}

    def dying_save(opt, path):  # the process "dies" while writing the second saved state
        calls["n"] += 1
        if calls["n"] == 2:
            path.write_bytes(b"half a file")
            raise KeyboardInterrupt
        real(opt, path)

    monkeypatch.setattr(resume, "save_optimizer", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out, tiny_dir), progress=False, log=lambda s: None)
    assert resume.latest_state(out) == out / "checkpoints" / "step-00000002"
    monkeypatch.setattr(resume, "save_optimizer", real)
    result = train(_cfg(out, tiny_dir, resume=str(out)), progress=False, log=lambda s: None)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_resume_without_a_complete_saved_state_is_refused(tmp_path) -> None:
    out = tmp_path / "half"
    out.mkdir()
    resume.write_config(out, {"train.seed": 0})
    (out / resume.LATEST).write_text("checkpoints/step-00000002\n")  # its folder never landed
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ValueError, match="no complete saved state to resume from"):
        train(_cfg(out, None, resume=str(out)), progress=False, log=lambda s: None)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_bad_input_fails_before_anything_is_written(tmp_path, tiny_dir) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="longer than the model allows"):
        train(_cfg(out, tiny_dir, seq_len=128), progress=False, log=lambda s: None)
    bad_lora = replace(_cfg(out, tiny_dir), lora=LoraOptions(target_modules="nope_proj"))
    with pytest.raises(ValueError, match="match no linear layer"):
        train(bad_lora, progress=False, log=lambda s: None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no training text"):
        train(replace(_cfg(out, tiny_dir), data=DataOptions(path=str(empty))), progress=False,
              log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(_cfg(out, tmp_path / "no-model"), progress=False, log=lambda s: None)
    assert not out.exists()

    done = tmp_path / "done"
    train(_cfg(done, tiny_dir, steps=2), progress=False, log=lambda s: None)
    before = {p: p.stat().st_mtime_ns for p in done.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="already holds a run"):
        train(_cfg(done, tiny_dir, steps=2), progress=False, log=lambda s: None)
    other = replace(_cfg(done, tiny_dir, steps=4, resume=str(done)),
                    optimizer=OptimizerOptions(lr=5e-3))
    with pytest.raises(ValueError, match="optimizer.lr"):
        train(other, progress=False, log=lambda s: None)
    assert before == {p: p.stat().st_mtime_ns for p in done.rglob("*") if p.is_file()}


def test_cli_trains_and_reports_errors(tmp_path, tiny_dir, capsys) -> None:
    out = tmp_path / "cli"
    rc = main(["train", "--model", str(tiny_dir), "--out", str(out), "--steps", "2",
               "--batch-size", "2", "--seq-len", "16", "--checkpoint", "every",
               "--loss-chunks", "8", "--optimizer", "paged_adamw", "--device-budget", "none",
               "--lora-r", "2", "--lora-target-modules", "q_proj,v_proj"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "quantization constants" in text and "adapter" in text
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["lora.target_modules"] == ["q_proj", "v_proj"] and cfg["prepare.loss_chunks"] == 8
    # every piece off but LoRA: the same loop and report, with nothing to save in most rows
    rc = main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "plain"),
               "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--quant", "none",
               "--checkpoint", "none", "--loss-chunks", "none", "--optimizer", "adamw"])
    assert rc == 0
    report = json.loads((tmp_path / "plain" / "report.json").read_text())
    rows = {r["name"]: r for r in report["pieces"]}
    # no 4-bit layers, no plan, no chunks: rows that say what ran, marked off, no saving
    assert rows["base weights"]["with"] == "not quantized (float32)"
    assert not rows["base weights"]["used"] and rows["base weights"]["saved_bytes"] == 0
    assert rows["activations"]["with"] == "no checkpointing, unchunked loss"
    assert rows["activations"]["with_bytes"] == rows["activations"]["without_bytes"]
    assert report["meta"]["off"] == ["base weights", "quantization constants",
                                     "activations"]
    capsys.readouterr()
    rc = main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "x"),
               "--seq-len", "4096"])
    assert rc == 2
    assert "longer than the model allows" in capsys.readouterr().err
    rc = main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "z"), "--zero3"])
    assert rc == 2
    assert "--zero3 only applies to FSDP2" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()
    rc = main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), "--fsdp-offload"])
    assert rc == 2
    assert "--fsdp-offload keeps FSDP2's shards on the host; add --fsdp" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_model_folder_tokenizer_is_used(tmp_path, tiny_dir) -> None:
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tightfit.train.data import HFTokenizer, load_train_data

    text = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int\n" * 40
    (tmp_path / "code.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)

    data_opts = DataOptions(path=str(tmp_path / "code.txt"))
    data = load_train_data(data_opts, HFTokenizer(folder), seq_len=32, batch_size=2,
                           grad_accum=1, seed=0)
    assert data.summary["tokens"] < len(text.encode()) / 2  # BPE merges, not bytes
    result = train(replace(_cfg(tmp_path / "out", folder, steps=2), data=data_opts),
                   progress=False, log=lambda s: None)
    assert len(result.history) == 2
    cfg = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert cfg["data.fingerprint"] == data.fingerprint
    data.close()


# A run with every new piece in its trajectory: records, an eval split, a cosine schedule,
# gradient accumulation, packing, dropout. Interrupted after its step-3 save and resumed from
# the folder alone, it must equal the uninterrupted run bit for bit.
RESUME_ARGS = ["--steps", "6", "--batch-size", "2", "--grad-accum", "2", "--seq-len", "48",
               "--save-every", "3", "--eval-every", "2", "--track-every", "0",
               "--lr-schedule", "cosine", "--warmup-steps", "2", "--eval-fraction", "0.2",
               "--batching", "pack", "--lr", "1e-2", "--lora-r", "4", "--lora-alpha", "8",
               "--checkpoint", "none", "--device-budget", "none"]  # fmt: skip


def _records(tmp_path: Path) -> Path:
    from .helpers import write_jsonl

    return write_jsonl(tmp_path / "qa.jsonl", [
        {"prompt": f"question {i}: what is {i} plus {i % 7}?", "completion": f" {2 * i % 97}"}
        for i in range(40)])


def test_resume_from_the_folder_alone_is_bit_exact(tmp_path, tiny_dir, monkeypatch) -> None:
    data = _records(tmp_path)
    base = ["train", "--model", str(tiny_dir), "--data", str(data), *RESUME_ARGS]
    assert main([*base, "--out", str(tmp_path / "full")]) == 0

    real = Batcher.step

    def dies_at_step_4(self, step):  # the 4th step never comes: a kill after step 3's save
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(Batcher, "step", dies_at_step_4)
    assert main([*base, "--out", str(tmp_path / "cut")]) == 130  # Ctrl-C's exit code
    monkeypatch.setattr(Batcher, "step", real)
    assert resume.saved_step(resume.latest_state(tmp_path / "cut")) == 3
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0  # nothing else given

    full = json.loads((tmp_path / "full" / "report.json").read_text())["meta"]
    cut = json.loads((tmp_path / "cut" / "report.json").read_text())["meta"]
    assert [e["eval_loss"] for e in full["eval"]] == [e["eval_loss"] for e in cut["eval"]]
    assert [e["step"] for e in cut["eval"]] == [2, 4, 6]
    a, b = _adapter(tmp_path / "full"), _adapter(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fa = (resume.latest_state(tmp_path / "full") / "optimizer.pt").read_bytes()
    fb = (resume.latest_state(tmp_path / "cut") / "optimizer.pt").read_bytes()
    assert fa == fb


def test_resume_refuses_what_would_change_the_run(tmp_path, tiny_dir, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny_dir), "--data", str(_records(tmp_path)),
                 "--out", str(run), *RESUME_ARGS, "--steps", "2"]) == 0
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    refused = [
        (["--lr", "1e-3"], "--lr 0.001 (saved: 0.01)"),
        (["--steps", "4", "--lora-r", "8"], "--lora-r 8 (saved: 4)"),
        (["--steps", "4", "--out", str(tmp_path / "other")], "drop --out"),
        ([], "has done 2 steps; pass --steps N with N > 2"),
        (["--steps", "2"], "has done 2 steps"),
    ]
    for extra, message in refused:
        assert main(["train", "--resume", str(run), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "other").exists()
    assert before == {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    # the saved options given again, and options that cannot change the math, are fine
    assert main(["train", "--resume", str(run), "--steps", "3", "--lr", "1e-2",
                 "--save-every", "5", "--track-every", "1"]) == 0
    assert resume.saved_step(resume.latest_state(run)) == 3
