"""Issue 18 item 6 (and 3-5 as ``tightfit train`` meets them): every bad input to ``tightfit
train`` is one error line with exit code 2 and writes nothing; a damaged saved state is refused
before anything changes; a resume removes the temps of runs that were killed and says so."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tightfit.cli import main
from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.train import resume
from tightfit.train.loop import RunConfig, TrainOptions, train

FAST = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--lora-r", "2",
        "--track-every", "0", "--checkpoint", "none"]  # fmt: skip


def _files(root: Path) -> dict[Path, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _refused(argv: list[str], capsys) -> str:
    """Run ``tightfit`` with ``argv``, expecting exit code 2; the one error line it printed."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refuses a flag's value itself
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 2, (argv, captured.err)
    assert "Traceback" not in captured.err + captured.out
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("tightfit train: error: "), captured.err
    said = [line for line in captured.err.splitlines() if line.strip() and "%|" not in line]
    assert len(said) <= 2, captured.err  # but progress bars; argparse adds a short usage
    return errors[0]


def _dead_token() -> str:
    """The owner token (:mod:`tightfit.integrity.temps`) of a process that has exited."""
    code = "from tightfit.integrity.temps import owner_token; print(owner_token())"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_each_bad_flag_is_one_line_exit_2_and_writes_nothing(tmp_path, tiny_dir, capsys) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    broken = tmp_path / "broken-config"
    shutil.copytree(tiny_dir, broken)
    (broken / "config.json").write_text('{"model_type": "llama", ')  # cut short
    weightless = tmp_path / "no-weights"
    weightless.mkdir()
    shutil.copy(tiny_dir / "config.json", weightless / "config.json")
    before = _files(tmp_path)
    model = ["--model", str(tiny_dir)]
    cases = [
        ([*model, "--device", "foo"], "--device 'foo' is not a device"),
        ([*model, "--device", "cuda:7"], "--device cuda:7"),
        (["--model", str(broken)], "config.json' is not valid JSON"),
        (["--model", str(weightless)], "has no weights"),
        ([*model, "--lr", "inf"], "argument --lr: invalid value 'inf'; expected a finite number"),
        ([*model, "--lr", "nan"], "argument --lr: invalid value 'nan'; expected a finite"),
        ([*model, "--lr", "-1e-3"], "learning rate must be > 0, got -0.001"),
        ([*model, "--weight-decay", "nan"], "argument --weight-decay: invalid value 'nan'"),
        ([*model, "--device-budget", "-1GiB"],
         "argument --device-budget: a size must be positive, got '-1GiB'"),
        ([*model, "--page-bytes", "0"], "argument --page-bytes: a size must be positive, got '0'"),
        ([*model, "--page-bytes", "4 MiBs"], "argument --page-bytes: unknown unit 'MiBs'"),
    ]
    for i, (extra, message) in enumerate(cases):
        out = tmp_path / f"run-{i}"
        line = _refused(["train", *extra, "--out", str(out), *FAST], capsys)
        assert message in line, (extra, line)
        assert not out.exists(), extra  # no run folder, so no run_config.json
    # --out naming a file, or a folder under a file
    for out in (tmp_path / "a-file", tmp_path / "a-file" / "run"):
        line = _refused(["train", *model, "--out", str(out), *FAST], capsys)
        assert "is a file" in line, line
    assert _files(tmp_path) == before  # nothing written or touched anywhere


def test_the_python_api_refuses_a_learning_rate_that_is_not_finite(tmp_path, tiny_dir) -> None:
    for lr, decay in ((float("nan"), 0.0), (float("inf"), 0.0), (1e-3, float("nan"))):
        out = tmp_path / "run"
        cfg = RunConfig(train=TrainOptions(model=str(tiny_dir), out=str(out), steps=2),
                        optimizer=OptimizerOptions(lr=lr, weight_decay=decay))
        with pytest.raises(ValueError, match="must be a finite number"):
            train(cfg, progress=False, log=lambda _msg: None)
        assert not out.exists()  # refused before the folder or run_config.json


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_dir) -> Path:
    """A 2-step run with its saved state (read only: tests damage copies)."""
    root = tmp_path_factory.mktemp("bad-input")
    data = root / "text.txt"  # a little text: the built-in corpus takes seconds to tokenize
    data.write_text(" ".join(f"word{i % 50}" for i in range(4000)))
    out = root / "run"
    assert main(["-q", "train", "--model", str(tiny_dir), "--data", str(data), "--out", str(out),
                 *FAST]) == 0
    return out


def _damage_bytes(path: Path, at: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    at = at % len(data)
    data[at : at + count] = bytes(b ^ 0xFF for b in data[at : at + count])
    path.write_bytes(bytes(data))


def _damages(state: Path) -> dict[str, tuple]:
    adapter = next((state / "adapter").glob("*.safetensors"))
    return {
        # the case: 1,000 bytes of the optimizer's pages overwritten
        # (the page's 28 params: three by name, then the rest as a range; the optimizer's own
        # advice, "save it again", is not repeated before the CLI's)
        "optimizer.pt": (lambda: _damage_bytes(state / "optimizer.pt", -1100, 1000),
                         r"optimizer.pt is refused: the optimizer state of page 0 \(param group "
                         r"0: param 0 elements 0\.\.63, param 1 elements 0\.\.63, param 2 "
                         r"elements 0\.\.63, 25 more params \(3\.\.27\)\).*does not match its "
                         r"checksum[^;]*partial copy\)\. Nothing was changed; restore the run"),
        "trainer_state.pt": (lambda: _damage_bytes(state / "trainer_state.pt", 40, 16),
                             "trainer_state.pt does not match its checksum"),
        "adapter": (lambda: _damage_bytes(adapter, -50, 8),
                    f"adapter/{adapter.name} does not match its checksum"),
        "adapter gone": (adapter.unlink, f"adapter/{adapter.name} is missing"),
        # a saved state from before checksums.json: the damaged file itself is refused
        "old trainer_state.pt": (
            lambda: ((state / resume.CHECKSUMS).unlink(),
                     (state / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut")),
            "trainer_state.pt cannot be read"),
        "old adapter": (
            lambda: ((state / resume.CHECKSUMS).unlink(), adapter.write_bytes(b"\x00" * 12)),
            "the adapter cannot be read"),
        "run_config.json": (lambda: (state.parent.parent / "run_config.json").write_text("{"),
                            "run_config.json' is not valid JSON"),
    }


def test_a_damaged_saved_state_is_refused_in_one_line_and_changes_nothing(
    finished_run, tmp_path, capsys
) -> None:
    token = _dead_token()
    for label in _damages(resume.latest_state(finished_run)):
        run = tmp_path / label.replace(" ", "-").replace(".", "-")
        shutil.copytree(finished_run, run)
        leftover = run / f".LATEST.tmp-{token}-0123456789ab"  # a killed run's temp
        leftover.write_text("step-00000001")
        damage, message = _damages(resume.latest_state(run))[label]
        damage()
        before = _files(run)
        line = _refused(["train", "--resume", str(run), "--steps", "3"], capsys)
        assert re.search(message, line), (label, line)
        assert _files(run) == before, label  # not even the dead process's temp is removed


def test_a_resume_removes_killed_runs_temps_and_says_so(finished_run, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    token = _dead_token()
    dead = [run / f".LATEST.tmp-{token}-0123456789ab",
            run / f".run_config.json.tmp-{token}-0123456789ab"]
    for path in dead:
        path.write_text("x" * 3000)
    dead_state = run / resume.STATES_DIR / f".tmp-{token}-0123456789ab-step-00000003"
    shutil.copytree(resume.latest_state(run), dead_state)  # a save killed before its rename
    kept = [run / ".LATEST.tmp-4242", run / resume.STATES_DIR / ".tmp-step-00000005-4242"]
    for path in kept:  # names of older versions: no owner in them, never touched
        path.write_text("")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "cleaned up after processes that no longer run (pid [" in text
    assert all(p.name in text for p in dead) and dead_state.name in text
    assert not any(p.exists() for p in [*dead, dead_state])
    assert all(p.exists() for p in kept)
    assert resume.saved_step(resume.latest_state(run)) == 3
    # the run's own temps are gone once it has finished
    assert sorted(p.name for p in run.iterdir() if ".tmp-" in p.name) == [".LATEST.tmp-4242"]


def test_an_interrupted_config_write_leaves_no_temp_and_the_old_file(tmp_path, monkeypatch) -> None:
    resume.write_config(tmp_path, {"a": 1})
    real_replace = resume.os.replace

    def interrupted(src, dst):  # a Ctrl-C after the temp was written, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(resume.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resume.write_config(tmp_path, {"a": 2})
    monkeypatch.setattr(resume.os, "replace", real_replace)
    assert [p.name for p in tmp_path.iterdir()] == [resume.CONFIG]
    assert resume.read_config(tmp_path) == {"a": 1}


# Issue 28 item 4: what needs no model is refused before the loop's imports (transformers'
# models, peft, bitsandbytes, datasets: seconds on 2 cores), and reads right. The model
# folder's check may read transformers.utils' file names (0.6 s), nothing more.
_REFUSE_EARLY = """
import sys
from tightfit.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("transformers.modeling_utils", "peft", "bitsandbytes", "datasets")
               if m in sys.modules)
print("RESULT", rc, ",".join(heavy) or "-")
"""


@pytest.mark.parametrize("case", ["seq-len", "lr", "no-data", "empty-data", "empty-eval",
                                  "no-model", "no-tokenizer", "nothing-saved", "out-is-file"])
def test_input_that_needs_no_model_is_refused_before_the_heavy_imports(case: str, tmp_path,
                                                                        tiny_dir) -> None:
    bare = tmp_path / "bare"  # a model folder without its tokenizer
    bare.mkdir()
    for f in tiny_dir.iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, bare / f.name)
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    run = tmp_path / "run"  # a run killed before its first save: a config, no saved state
    run.mkdir()
    resume.write_config(run, {"data.path": None})
    argv, said = {
        "seq-len": (["--seq-len", "0"], "--seq-len must be >= 2 tokens"),
        "lr": (["--lr", "-1"], "learning rate must be > 0"),
        "no-data": (["--data", str(tmp_path / "nope.txt")], "does not exist"),
        "empty-data": (["--data", str(empty)], "is an empty file; pass --data"),
        "empty-eval": (["--eval-data", str(empty)], "is an empty file; pass --eval-data"),
        "no-model": (["--model", str(tmp_path / "nomodel")], "model folder"),
        "no-tokenizer": (["--model", str(bare)], "has no tokenizer"),
        "nothing-saved": (["--resume", str(run), "--data", str(empty)], "nothing saved yet"),
        "out-is-file": (["--out", str(empty)], "is a file, not a folder"),
    }[case]
    proc = subprocess.run([sys.executable, "-c", _REFUSE_EARLY, "train", *argv],
                          capture_output=True, text=True, timeout=120)
    result = proc.stdout.split("RESULT ")[-1].split()
    assert result == ["2", "-"], (proc.stdout, proc.stderr)  # exit 2, nothing heavy imported
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and said in errors[0], proc.stderr
