"""Output conventions: messages through logging (-v, --quiet), --version and ``python -m
tightfit``, Ctrl-C and SIGTERM save the last completed step and exit 130 / 143, third-party
noise hidden, type hints shipped (py.typed)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

import tightfit
from tightfit.cli import main, quiet_third_party
from tightfit.train import resume

ARGS = ["--batch-size", "2", "--seq-len", "16", "--checkpoint", "every", "--track-every", "0",
        "--lora-r", "2", "--device-budget", "none", "--threads", "1"]
MiB = 1 << 20
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def test_version_and_python_m_tightfit(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tightfit {tightfit.__version__}"
    run = subprocess.run([sys.executable, "-m", "tightfit", "--version"], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert run.returncode == 0 and run.stdout.strip() == f"tightfit {tightfit.__version__}"


def test_type_hints_ship_with_the_package() -> None:
    assert resources.files("tightfit").joinpath("py.typed").is_file()
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'tightfit = ["py.typed"]' in pyproject  # packaged with the wheel, not only here


def test_the_bitsandbytes_kernels_warning_is_not_shown() -> None:
    # the message bitsandbytes logs on import on AVX512-BF16 CPUs without `kernels`
    source = Path(resources.files("bitsandbytes") / "backends" / "cpu" / "ops.py").read_text()
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in source
    quiet_third_party()
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please "
                    "make sure you already `pip install kernels`", "No module named 'kernels'")
        log.warning("another bitsandbytes warning")  # only that one message is hidden
    finally:
        log.removeHandler(handler)
    assert shown == ["another bitsandbytes warning"]


def test_quiet_and_verbose(tmp_path, tiny_dir, capsys) -> None:
    assert main(["-q", "train", "--model", str(tiny_dir), "--out", str(tmp_path / "q"),
                 "--steps", "1", *ARGS]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {tmp_path / 'q'}/:") and "note:" not in out
    assert "train:" not in err  # no progress bar
    assert main(["train", "-v", "--model", str(tiny_dir), "--out", str(tmp_path / "v"),
                 "--steps", "2", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "note:" in out and "step 1 done: loss" in out and "step 2 done: loss" in out


def test_quiet_prints_only_warnings_and_errors_and_nothing_twice(tmp_path, tiny_dir,
                                                                  capfd) -> None:
    """Issue 28 item 5: -q train and -q export --merge print their results alone: no
    transformers "Loading weights" / "Writing model shards" bars, no datasets bars, no
    FutureWarning from peft's calls; a refused data file is one message, not datasets' too."""
    import warnings

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 50}" for i in range(2000)))
    out = tmp_path / "run"
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["-q", "train", "--model", str(tiny_dir), "--data", str(text), "--out",
                     str(out), "--steps", "1", *ARGS]) == 0
        trained = capfd.readouterr()
        assert main(["-q", "export", str(out), "--merge"]) == 0
        exported = capfd.readouterr()
    assert trained.err == "" and exported.err == "", (trained.err, exported.err)
    assert trained.out.startswith(f"wrote {out}/:")
    assert exported.out.split() == ["adapter", str(out / "export" / "adapter"),
                                    "merged", str(out / "export" / "merged")]
    shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning,
                                                             PendingDeprecationWarning))]
    assert not shown, [str(w.message) for w in shown]  # what Python would print by default
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 3 + '{"text": "cut\n')
    assert main(["-q", "train", "--model", str(tiny_dir), "--data", str(bad), "--out",
                 str(tmp_path / "never"), *ARGS]) == 2
    refused = capfd.readouterr()
    assert refused.out == ""
    assert " ".join(refused.err.split()) == (
        f"tightfit train: error: data file {str(bad)!r} is not valid JSON / JSON Lines: line 4, "
        "column 10: Unterminated string starting; fix the file.")


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_ctrl_c_and_sigterm_save_the_last_completed_step_and_leave_no_temp_folder(
        tmp_path, tiny_dir, sig, code, said) -> None:
    """Issue 28 item 3: SIGTERM (docker stop, SLURM, timeout) as Ctrl-C: the last completed step
    saved, a one-line message, exit 128 + the signal, and nothing left in the temp folder."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    env = {**ENV, "TMPDIR": str(tmp)}  # the run's temporary folders go here
    cmd = [sys.executable, "-m", "tightfit", "-v", "train", "--model", str(tiny_dir), "--out",
           str(out), "--steps", "500", "--save-every", "1000", *ARGS]
    with open(tmp_path / "stderr.txt", "w") as errfile:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errfile, text=True, env=env)
        try:
            for line in proc.stdout:  # debug lines: "step N done: ..."
                if line.startswith("step 3 done"):
                    break
            else:
                pytest.fail(f"the run ended early: {(tmp_path / 'stderr.txt').read_text()}")
            assert [p.name for p in tmp.iterdir() if p.name.startswith("tightfit-data-")]
            proc.send_signal(sig)  # what Ctrl-C / docker stop send
            rest = proc.stdout.read()
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = (tmp_path / "stderr.txt").read_text()
    assert rc == code, err
    text = " ".join(err.replace("\r", "\n").split())  # the message may wrap at 100 columns
    last = text[text.rindex(f"tightfit train: {said}; the state of step "):]
    assert last.endswith(f"continue with `tightfit train --resume {out}`."), last
    done = max(int(ln.split()[1]) for ln in ["step 3 done", *rest.splitlines()]
               if ln.startswith("step ") and " done" in ln)
    saved = resume.latest_state(out)
    assert saved is not None and resume.saved_step(saved) == done  # the last completed step
    assert f"the state of step {done} is saved in {out}" in last
    state = torch.load(saved / "trainer_state.pt", weights_only=False)
    assert [h["step"] for h in state["history"]] == list(range(1, done + 1))
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert _left_in(tmp) == []  # the data cache and the spill folder are gone
    # and the run continues from it
    assert subprocess.run([sys.executable, "-m", "tightfit", "-q", "train", "--resume", str(out),
                           "--steps", str(done + 1)], env=env, timeout=300,
                          capture_output=True).returncode == 0
    assert resume.saved_step(resume.latest_state(out)) == done + 1
    assert _left_in(tmp) == []


def _left_in(tmp: Path) -> list[str]:
    """What a run left in its temp folder, but torch's compile cache (torchinductor_USER, kept
    across runs on purpose)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _drawn(monkeypatch) -> list:
    """The figures the plots draw, kept open for the test to read."""
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)
    return figs


def _labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_timeline_shows_the_total_labels_paging_and_leaves_out_empty_panels(
        tmp_path, monkeypatch) -> None:
    from tightfit.train.plots import plot_timeline, timeline_panels

    figs = _drawn(monkeypatch)
    budget = 4 * MiB
    steps = [{"step": s, "mem_total": (100 + s) * MiB, "host_rss_peak": 120 * MiB,
              "target_bytes": 150 * MiB, "device_bytes": budget, "device_budget": budget,
              "paged_in": 0, "paged_out": 0, "time": float(s)} for s in (1, 2, 3)]
    assert timeline_panels(steps) == ["memory", "state"]  # no paging: no empty panel
    plot_timeline(steps, tmp_path / "a.png")
    memory, state = figs[-1].axes
    assert _labels(memory) == ["process RSS at the end of the step", "RSS high-water mark so far",
                               "target (pages leave the device above it)"]
    # the state equals its budget: one line saying so, not one hidden under the other
    assert len(state.get_lines()) == 1 and "= --device-budget" in _labels(state)[0]

    steps[1].update(paged_out=2 * MiB, device_bytes=budget // 2)
    steps[2].update(paged_in=2 * MiB)
    assert timeline_panels(steps) == ["memory", "state", "paging"]
    plot_timeline(steps, tmp_path / "b.png")
    _, state, paging = figs[-1].axes
    assert _labels(state) == ["optimizer state on the device", "device budget"]
    assert _labels(paging) == ["paged in (to the device)", "paged out (off the device)"]
    assert paging.get_ylim()[0] == 0  # both upward: no unlabelled negative axis
    heights = sorted(round(p.get_height()) for p in paging.patches)  # MiB
    assert heights == [0, 0, 0, 0, 2, 2]
    assert timeline_panels([{"step": 1, "device_bytes": 0}]) == []  # nothing: nothing drawn


def test_the_loss_plot_shows_the_eval_loss_when_there_is_one(tmp_path, monkeypatch) -> None:
    from tightfit.train.plots import plot_loss

    figs = _drawn(monkeypatch)
    hist = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "eval_loss": 2.7}]
    plot_loss(hist, tmp_path / "a.png")
    (ax,) = figs[-1].axes
    assert _labels(ax) == ["training loss", "eval loss"]
    assert list(ax.get_lines()[1].get_ydata()) == [2.7]
    plot_loss(hist[:1], tmp_path / "b.png")
    assert figs[-1].axes[0].get_legend() is None and len(figs[-1].axes[0].get_lines()) == 1
