"""Spike-proof by default, and stopping loses nothing: the default run has a target and a
watch, an out-of-memory error in backward is retried once without changing the result, a
second one stops with the batch named and the last completed step saved."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tightfit.cli import main
from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.pressure import probes
from tightfit.qlora.prepare_options import LoraOptions
from tightfit.train import resume, run_setup
from tightfit.train.loop import RunConfig, TrainOptions, train
from tightfit.train.step import StepOutOfMemory

ARGS = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--checkpoint", "every",
        "--track-every", "0", "--lora-r", "2", "--device-budget", "none"]


def _cfg(out: Path, model: Path, **train_kw) -> RunConfig:
    kw = {"batch_size": 2, "seq_len": 32, "steps": 4, "save_every": 2, "track_every": 2}
    kw.update(train_kw)
    # dropout: the retry must draw the same masks; 16 KiB pages: a drain moves some
    return RunConfig(train=TrainOptions(model=str(model), out=str(out), **kw),
                     lora=LoraOptions(r=4, alpha=8, dropout=0.1),
                     optimizer=OptimizerOptions(lr=1e-2, page_bytes=16 << 10))


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _built_optimizers(monkeypatch) -> list[dict]:
    """The memory_stats() of every optimizer the train job builds, read as it is built."""
    seen: list[dict] = []
    real = run_setup.optimizer_for

    def recording(*args, **kwargs):
        opt = real(*args, **kwargs)
        seen.append(opt.memory_stats() if hasattr(opt, "memory_stats") else {})
        return opt

    monkeypatch.setattr(run_setup, "optimizer_for", recording)
    return seen


def test_the_default_run_has_a_target_and_watches_the_model(tmp_path, tiny_dir, monkeypatch,
                                                            capsys) -> None:
    limit = 64 << 30  # as if this process ran under a memory cgroup with a 64 GiB limit
    monkeypatch.setattr(probes, "cgroup_memory_limit", lambda: limit)
    seen = _built_optimizers(monkeypatch)
    assert main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "a"), *ARGS]) == 0
    assert seen[-1]["target_bytes"] == int(0.9 * limit)  # --target auto: 0.9 of the limit
    assert "watch_reads" in seen[-1]  # a live watch on the model's blocks
    assert "pressure: target 58,982.4 MiB (auto); watching" in capsys.readouterr().out
    paging = json.loads((tmp_path / "a" / "report.json").read_text())["paging"]
    assert paging["target_bytes"] == int(0.9 * limit) and paging["watch_reads"] > 0

    assert main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "b"), *ARGS,
                 "--target", "none"]) == 0
    assert "target_bytes" not in seen[-1] and "watch_reads" not in seen[-1]
    assert "pressure: off (--target none)" in capsys.readouterr().out
    # bytes on the CPU without a cgroup limit: the RSS probe against them
    monkeypatch.setattr(probes, "cgroup_memory_limit", lambda: None)
    assert main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "c"), *ARGS,
                 "--target", "6GiB"]) == 0
    assert seen[-1]["target_bytes"] == 6 << 30 and "watch_reads" in seen[-1]


def _fail_backward(monkeypatch, at: set[int]) -> dict[str, int]:
    """Make the n-th backward through the model's final norm (counted from 1) raise
    ``torch.OutOfMemoryError`` for each n in ``at``, as an allocation there would."""
    calls = {"n": 0}
    real = run_setup.prepare

    def prepare_with_fault(*args, **kwargs):
        model = real(*args, **kwargs)

        def grad_hook(grad: torch.Tensor) -> None:
            calls["n"] += 1
            if calls["n"] in at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                             "(injected by the test)")

        def forward_hook(module, args, output) -> None:
            if output.requires_grad:
                output.register_hook(grad_hook)

        model.get_base_model().model.norm.register_forward_hook(forward_hook)
        return model

    monkeypatch.setattr(run_setup, "prepare", prepare_with_fault)
    return calls


def test_an_oom_in_backward_is_retried_once_and_ends_as_an_uninjected_run(
        tmp_path, tiny_dir, monkeypatch) -> None:
    clean = train(_cfg(tmp_path / "clean", tiny_dir), progress=False, log=lambda s: None)
    _fail_backward(monkeypatch, at={3})  # the backward of step 3
    hit = train(_cfg(tmp_path / "hit", tiny_dir), progress=False, log=lambda s: None)
    assert [h["loss"] for h in hit.history] == [h["loss"] for h in clean.history]
    a, b = _adapter(clean.out), _adapter(hit.out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["oom_retry"] for h in hit.history] == [False, False, True, False]
    report = json.loads((hit.out / "report.json").read_text())
    assert report["paging"]["oom_retries"] == 1
    # the state was drained off the device for the retry, and the step streamed it
    assert report["paging"]["bytes_paged_out"] > 0
    assert any(h["paged_in"] > 0 for h in hit.history[2:])
    assert all(h["paged_in"] == 0 for h in clean.history)
    assert "1 steps retried" in hit.report.table()


def test_a_second_oom_stops_naming_the_batch_and_saves_the_last_step(
        tmp_path, tiny_dir, monkeypatch, capsys) -> None:
    out = tmp_path / "run"
    _fail_backward(monkeypatch, at={4, 5})  # step 4 and its retry
    with pytest.raises(StepOutOfMemory) as err:
        train(_cfg(out, tiny_dir, save_every=10), progress=False, log=lambda s: None)
    text = str(err.value)
    assert "step 4 again when retried" in text and "2 x 32 tokens" in text
    assert "tightfit plan --model" in text and "--seq-len 32" in text
    assert f"the state of step 3 is saved in {out}" in text
    saved = resume.latest_state(out)
    assert resume.saved_step(saved) == 3  # the last completed step, nothing of step 4
    state = torch.load(saved / "trainer_state.pt", weights_only=False)
    assert [h["step"] for h in state["history"]] == [1, 2, 3]
    # resuming it (no more faults) ends where an uninterrupted run ends, bit for bit
    monkeypatch.undo()
    full = train(_cfg(tmp_path / "full", tiny_dir), progress=False, log=lambda s: None)
    resumed = train(replace(_cfg(out, tiny_dir), train=replace(
        _cfg(out, tiny_dir).train, resume=str(out))), progress=False, log=lambda s: None)
    a, b = _adapter(full.out), _adapter(resumed.out)
    assert all(torch.equal(a[k], b[k]) for k in a)

    _fail_backward(monkeypatch, at={1, 2})
    rc = main(["train", "--model", str(tiny_dir), "--out", str(tmp_path / "cli"), *ARGS])
    assert rc == 1
    err_text = capsys.readouterr().err
    assert "out of memory in forward/backward of step 1" in err_text
    assert "no step was completed, nothing saved" in err_text


def test_the_drain_runs_after_the_failed_attempt_is_freed(tmp_path, tiny_dir, monkeypatch) -> None:
    # The drain (and the retry) run outside the `except` that caught the error: inside it,
    # the traceback kept the failed forward's frames and so its loss and autograd graph (the
    # activations) alive while the drain and the retry allocated.
    import weakref

    from tightfit.train import step as step_mod

    losses: list[weakref.ref] = []
    real_prepare = run_setup.prepare

    def prepare_recording(*args, **kwargs):
        model = real_prepare(*args, **kwargs)
        model.register_forward_hook(lambda m, a, out: losses.append(weakref.ref(out.loss)))
        return model

    monkeypatch.setattr(run_setup, "prepare", prepare_recording)
    _fail_backward(monkeypatch, at={3})
    alive_at_drain: list[int] = []
    real_drain = step_mod._drain

    def drain(optimizer, why):
        alive_at_drain.append(sum(r() is not None for r in losses))
        return real_drain(optimizer, why)

    monkeypatch.setattr(step_mod, "_drain", drain)
    hit = train(_cfg(tmp_path / "hit", tiny_dir, steps=3), progress=False, log=lambda s: None)
    assert [h["oom_retry"] for h in hit.history] == [False, False, True]
    assert len(losses) >= 3 and alive_at_drain == [0]  # before: [1], the failed step's loss
