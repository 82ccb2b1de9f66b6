"""Issue 28 item 8: the log says which tokens train, shows one example with them marked, and
how many passes over the data the steps make; ``--epochs`` sets the steps by passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tightfit.cli import main
from tightfit.train.data.pipeline import _trained, preview
from tightfit.train.data.records import IGNORE
from tightfit.train.data.tokenizer import ByteTokenizer

from .helpers import write_jsonl

FAST = ["--batch-size", "8", "--seq-len", "64", "--lora-r", "2", "--track-every", "0",
        "--checkpoint", "none", "--save-every", "1000"]


class _One:
    """One example: "Q? A" with the loss on " A" (the prompt's labels -100)."""

    def get(self, positions: list[int]) -> list[tuple[list[int], list[int]]]:
        ids = list(b"Q? A")
        return [(ids, [IGNORE, IGNORE, IGNORE, ids[3]])]


def test_the_preview_marks_the_tokens_the_loss_sees() -> None:
    assert preview(_One(), ByteTokenizer()) == "example 1, trained tokens in [[...]]: Q? [[A]]"
    assert preview(_One(), ByteTokenizer(), chars=2) == \
        "example 1, trained tokens in [[...]]: Q? ..."


def test_trained_tokens_are_named_in_the_formats_words() -> None:
    assert _trained("chat", True) == "the assistant turns' tokens"
    assert _trained("prompt-completion", True) == _trained("alpaca", True) == \
        "the completions' tokens"
    assert _trained("chat", False) == _trained("raw", True) == "every token"


@pytest.fixture
def qa(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "qa.jsonl", [
        {"prompt": f"What is {i} plus 1?", "completion": f" {i + 1}"} for i in range(32)])


def test_epochs_set_the_steps_and_the_log_says_so(qa: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--data", str(qa), "--epochs", "2", "--out", str(out), *FAST]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # notes wrap at 100 columns
    assert "32 examples" in printed and "trained (the completions' tokens)" in printed
    assert "example 1, trained tokens in [[...]]: What is" in printed and "[[ " in printed
    assert "8 steps are 2 epochs of the data (4 steps an epoch of 32 examples)" in printed
    assert json.loads((out / "report.json").read_text())["meta"]["steps"] == 8


def test_steps_and_epochs_together_are_refused(qa: Path, tmp_path: Path, capsys) -> None:
    argv = ["train", "--data", str(qa), "--epochs", "1", "--steps", "3", "--out",
            str(tmp_path / "run")]
    assert main(argv) == 2
    assert "--steps and --epochs both say how long to train" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["train", "--epochs", "0"]) == 2
    assert "--epochs must be a number of passes > 0" in capsys.readouterr().err
