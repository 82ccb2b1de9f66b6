"""Training data: byte tokens, the stdlib corpus, batches as a pure function of (seed, step)."""

from __future__ import annotations

import pytest
import torch

from tightfit.train.data import ByteTokenizer, TokenData, read_corpus


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    data = TokenData.from_text(text, tok)
    assert data.tokens.tolist() == ids


def test_stdlib_corpus_is_python_source() -> None:
    text = read_corpus(None, max_bytes=50_000)
    assert len(text) == 50_000
    assert "def " in text and "import " in text


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    data = TokenData.from_text("abcdefghij" * 100, ByteTokenizer())
    a = data.batch(3, 4, 16, seed=1)
    b = data.batch(3, 4, 16, seed=1)
    c = data.batch(4, 4, 16, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    assert a["input_ids"].shape == (4, 16) and torch.equal(a["labels"], a["input_ids"])


def test_bad_data_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus(tmp_path / "nope")
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="no training text"):
        read_corpus(tmp_path)
    (tmp_path / "a.txt").write_text("short")
    data = TokenData.from_text(read_corpus(tmp_path / "a.txt"), ByteTokenizer())
    with pytest.raises(ValueError, match="smaller --seq-len"):
        data.check_fits(64)
