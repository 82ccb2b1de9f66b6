"""Issue 28 item 2: which tokenizer a run reads its data with. A model folder without tokenizer
files is refused (one line naming the folder and how to add one), whatever its vocabulary;
bytes only for the built-in model or with ``--tokenizer bytes``; ``--tokenizer DIR`` reads a
tokenizer saved elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tightfit.cli import main
from tightfit.train.data import ByteTokenizer, HFTokenizer, load_tokenizer

from .helpers import byte_tokenizer, tiny_llama

FAST = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--lora-r", "2",
        "--track-every", "0", "--checkpoint", "none", "--device-budget", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> dict[int, Path]:
    """Model folders without a tokenizer: vocabularies of 256 and of 200 ids."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    return {v: tiny_llama(root / f"vocab-{v}", vocab_size=v) for v in (256, 200)}


def _error(argv: list[str], capsys) -> str:
    """The one error message ``argv`` ends with (exit code 2), its wrapped lines joined."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    said = " ".join(ln for ln in err.splitlines() if ln.strip() and "%|" not in ln)  # no bars
    text = " ".join(said.split())
    assert text.startswith("tightfit train: error: ") and text.count("error") == 1, err
    return text


def test_a_model_folder_without_a_tokenizer_is_refused_whatever_its_vocabulary(
        tmp_path, bare, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("plain ASCII text, bytes below 128\n" * 50)
    for vocab, folder in bare.items():
        out = tmp_path / f"run-{vocab}"
        line = _error(["train", "--model", str(folder), "--data", str(text), "--out", str(out),
                       *FAST], capsys)
        assert f"model folder {str(folder)!r} has no tokenizer (tokenizer.json" in line, line
        assert f"tokenizer.save_pretrained({str(folder)!r})" in line
        assert "--tokenizer DIR" in line and "--tokenizer bytes" in line
        assert "own tokenizer" not in line  # the old hint named one the folder does not have
        assert not out.exists()
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(str(bare[256]))
    assert isinstance(load_tokenizer(None), ByteTokenizer)  # the built-in model: bytes


def test_tokenizer_bytes_and_tokenizer_dir_are_the_explicit_ways(tmp_path, bare, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("plain text and a euro sign: € (its first byte is 226)\n" * 50)
    out = tmp_path / "bytes"
    assert main(["-q", "train", "--model", str(bare[256]), "--data", str(text), "--out",
                 str(out), "--tokenizer", "bytes", *FAST]) == 0
    assert json.loads((out / "run_config.json").read_text())["train.tokenizer"] == "bytes"
    capsys.readouterr()
    # bytes for a vocabulary too small for them: the id and the fix, before anything is written
    line = _error(["train", "--model", str(bare[200]), "--data", str(text), "--out",
                   str(tmp_path / "small"), "--tokenizer", "bytes", *FAST], capsys)
    assert ("--tokenizer bytes gives id 226 but the model's vocabulary has 200 entries, so it "
            "is not this model's tokenizer; pass the model's own with --tokenizer DIR.") in line
    assert not (tmp_path / "small").exists()
    # a tokenizer saved in a folder of its own
    tok_dir = tmp_path / "tok"
    byte_tokenizer().save_pretrained(tok_dir)
    assert isinstance(load_tokenizer(str(bare[256]), str(tok_dir)), HFTokenizer)
    out = tmp_path / "dir"
    assert main(["-q", "train", "--model", str(bare[256]), "--data", str(text), "--out",
                 str(out), "--tokenizer", str(tok_dir), *FAST]) == 0
    capsys.readouterr()
    for bad, what in ((tmp_path / "nowhere", "does not exist"), (tmp_path, "has no tokenizer")):
        line = _error(["train", "--model", str(bare[256]), "--data", str(text), "--out",
                       str(tmp_path / "never"), "--tokenizer", str(bad), *FAST], capsys)
        assert f"--tokenizer {str(bad)!r} {what}" in line, line
    assert not (tmp_path / "never").exists()
