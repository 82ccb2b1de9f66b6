"""Reading what ``tightfit train`` prints and writes (issue 28, item 9): every line fits 100
columns, ``dev=`` is MiB, report.json has the eviction and restore counts and the run's total
and peak, and the loss plot marks the resume and plots the learning rate."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tightfit.cli import main
from tightfit.optim.adamw import PagedAdamW
from tightfit.pressure.probes import Probe
from tightfit.report.text import WIDTH, pack
from tightfit.train import resume
from tightfit.train.plots import loss_curves, plot_loss
from tightfit.train.summary import paging_summary, run_memory

MiB = 1 << 20
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _lines(text: str) -> list[str]:
    """Every line as a terminal shows it (a progress bar redraws itself after each ``\\r``)."""
    return re.split(r"\r|\n", text)


def _too_wide(text: str) -> list[str]:
    return [line for line in _lines(text) if len(line) > WIDTH]


@pytest.fixture
def short_out() -> Iterator[Path]:
    """A short output folder: the files written are listed by their paths, which no wrapping
    may cut (pytest's own temporary folders are 70 columns and more)."""
    folder = Path(tempfile.mkdtemp(prefix="tf-"))
    yield folder / "out"
    shutil.rmtree(folder, ignore_errors=True)


def _tightfit(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tightfit", *args], capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_train_and_its_resume_print_nothing_wider_than_100_columns(short_out) -> None:
    out = short_out
    # the built-in demo: its notes, data line, plan, pressure note, report and summary
    first = _tightfit("train", "--steps", "2", "--lr-schedule", "cosine", "--out", str(out))
    assert _too_wide(first) == [] and "memory per piece" in first
    lines = _lines(first)
    for head in ("The built-in model is", "data: the first", "note: checkpoint budget:"):
        at = next(i for i, x in enumerate(lines) if x.startswith(head))  # 170-220 columns once
        assert lines[at + 1].startswith("  ") and not lines[at + 1].startswith("   ")
    assert "checkpoint plan:" in first and "head+loss" in first
    assert re.search(r"dev=\d+\.\d\dMiB", first) and "dev=100%" not in first  # MiB, always
    # resumed with more steps: a note on the schedule's horizon, the resume in the report
    again = _tightfit("train", "--resume", str(out), "--steps", "4")
    assert _too_wide(again) == []
    assert "note: --lr-schedule cosine decays over --steps" in again
    assert "run (steps 1-4, resumed at step 2)" in again
    assert "paging: no target (--target auto); since the resume at step 2" in again

    report = json.loads((out / "report.json").read_text())
    run = report["run"]
    assert (run["first_step"], run["last_step"], run["resumed_at"]) == (1, 4, [2])
    assert run["peak_bytes"] >= run["total_bytes"] > 0  # CPU: RSS high-water mark >= RSS
    paging = report["paging"]
    assert paging["evictions"] == paging["restores"] == 0  # no target on this machine
    assert paging["since_step"] == 2 and "evict_events" in paging
    # the run's bytes paged: both processes' steps; the pager's: the last process only
    assert run["bytes_paged_in"] > paging["bytes_paged_in"] > 0

    history = torch.load(resume.latest_state(out) / "trainer_state.pt",
                         weights_only=False)["history"]
    curves = loss_curves(history)
    assert curves["resumed_at"] == [2] and curves["loss"][0] == [1, 2, 3, 4]
    assert len(curves["lr"][1]) == 4 and curves["lr"][1][2] > curves["lr"][1][1]  # back up
    assert (out / "loss_curve.png").stat().st_size > 0


def test_a_long_note_and_an_offloading_plan_wrap_onto_indented_lines(tmp_path, tiny_dir, capsys,
                                                                      short_out) -> None:
    folder = tmp_path / " ".join(["a folder name long enough to wrap"] * 4)
    folder.mkdir()
    (folder / "train.txt").write_text("hello world, this is the text.\n" * 300)
    assert main(["train", "--model", str(tiny_dir), "--data", str(folder / "train.txt"),
                 "--out", str(short_out), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--lora-r", "2", "--threads", "1", "--checkpoint", "every",
                 "--offload", "all", "--target", "6GiB", "--track-every", "0"]) == 0
    out, err = capsys.readouterr()
    assert _too_wide(out + err) == []
    lines = _lines(out)
    data = next(i for i, x in enumerate(lines) if x.startswith("data: 1 text file(s) from"))
    assert lines[data + 1].startswith("  ") and "train.txt" in " ".join(lines[data:data + 4])
    assert "next tier" in out and "head+loss" in out  # the plan, offloading, fits
    assert "pressure: target 6,144.0 MiB (--target 6GiB); watching the model's blocks:\n  " \
        "optimizer pages" in out
    assert "paging: target 6144.00 MiB (--target 6GiB)" in out  # as typed, not in bytes


def test_pack_breaks_between_parts() -> None:
    parts = [f"part {i} " + "x" * 20 for i in range(8)]
    lines = pack(parts, "head: ", width=60)
    assert all(len(x) <= 60 for x in lines) and lines[0].startswith("head: part 0")
    assert all(x.endswith(";") for x in lines[:-1]) and all(x.startswith("  part") for x in
                                                             lines[1:])


def test_the_run_memory_is_over_all_steps_of_every_process() -> None:
    def rec(step: int, proc: int, total: int, peak: int, **kw) -> dict:
        return {"step": step, "process_step": proc, "mem_total": total * MiB,
                "host_rss_peak": peak * MiB, "paged_in": MiB, "paged_out": 0, **kw}

    # steps 1-3, resumed at 3 (a new process: its marks start again), at 5, then 6-7
    history = [rec(1, 1, 100, 150), rec(2, 2, 120, 160), rec(3, 3, 110, 160),
               rec(4, 1, 90, 130, oom_retry=True), rec(5, 2, 95, 170), rec(6, 1, 80, 100),
               rec(7, 2, 85, 100)]
    run = run_memory(history, "cpu")
    assert run["resumed_at"] == [3, 5] and (run["first_step"], run["last_step"]) == (1, 7)
    assert run["total_bytes"] == 120 * MiB and run["peak_bytes"] == 170 * MiB
    assert run["bytes_paged_in"] == 7 * MiB and run["oom_retries"] == 1
    cuda = [dict(h, mem_peak=h["mem_total"] + 5 * MiB) for h in history]
    assert run_memory(cuda, "cuda")["peak_bytes"] == 125 * MiB  # max_memory_allocated
    assert run_memory([], "cpu") == {}


class _Spiky(Probe):
    """A 16 MiB device: the optimizer's resident pages plus whatever else ``used`` says."""

    def __init__(self, used: dict) -> None:
        super().__init__()
        self.device, self.used = torch.device("cpu"), used

    def capacity_bytes(self) -> int:
        return 16 << 20

    def _used_bytes(self) -> int:
        return self.used["other"] + self.used["opt"].pager.device_bytes


def test_report_json_counts_the_optimizers_evictions_and_restores() -> None:
    ps = [nn.Parameter(torch.randn(64 << 10)) for _ in range(4)]  # 2 MiB of AdamW state
    used: dict = {"other": 0, "opt": None}
    opt = PagedAdamW(ps, page_bytes=256 << 10, target=8 << 20, probe=_Spiky(used))
    used["opt"] = opt
    try:
        for i, other in enumerate([0, 8 << 20, 0]):  # a spike at the second step
            used["other"] = other
            for p in ps:
                p.grad = torch.full_like(p, 0.01 * (i + 1))
            opt.step()
        stats = opt.memory_stats()
    finally:
        opt.close()
    run = types.SimpleNamespace(optimizer=opt, oom_retries=0, start=0, history=[],
                                cfg=types.SimpleNamespace(
                                    optimizer=types.SimpleNamespace(target=8 << 20)))
    paging = paging_summary(stats, run)
    assert paging["evictions"] == stats["evictions"] >= 1
    assert paging["restores"] == stats["restores"] >= 1
    assert paging["evict_events"] == stats["evict_events"] >= 1
    assert paging["evicted_bytes"] == stats["evicted_bytes"] > 0 and paging["since_step"] == 0


def test_the_loss_plot_marks_the_resume_and_plots_the_learning_rate(tmp_path,
                                                                     monkeypatch) -> None:
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)
    # 8 steps of a cosine schedule over 8, resumed at 8 with --steps 12: the rate jumps back up
    lrs = [1e-4, 9e-5, 7e-5, 5e-5, 3e-5, 1e-5, 5e-6, 0.0, 5e-5, 3e-5, 1e-5, 0.0]
    history = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": lr, "process_step": s if s <= 8 else s - 8}
               for s, lr in enumerate(lrs, 1)]
    curves = loss_curves(history)
    assert curves["resumed_at"] == [8] and curves["lr"] == (list(range(1, 13)), lrs)
    plot_loss(history, tmp_path / "loss.png")
    ax, rate = figs[-1].axes
    resumed = [ln for ln in ax.get_lines() if ln.get_label() == "resumed at step 8"]
    assert len(resumed) == 1 and list(resumed[0].get_xdata()) == [8, 8]  # a vertical line
    assert list(rate.get_lines()[0].get_ydata()) == lrs and rate.get_ylabel() == "learning rate"
    labels = [t.get_text() for t in rate.get_legend().get_texts()]
    assert labels == ["training loss", "resumed at step 8", "learning rate"]
