"""Plain-text data: byte tokens, the stdlib corpus, all of --data read (a cap only when asked
and then printed), batches as a pure function of (seed, step), non-UTF-8 files named; a killed
run's data cache removed by the next run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tightfit.train.data import ByteTokenizer, load_train_data
from tightfit.train.run_options import DataOptions


def _load(path, seq_len: int = 16, batch_size: int = 2, **data_kw):
    return load_train_data(DataOptions(path=None if path is None else str(path), **data_kw),
                           ByteTokenizer(), seq_len=seq_len, batch_size=batch_size,
                           grad_accum=1, seed=0)


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "a"], special=True) == [ids, [97]]


def test_stdlib_corpus_is_python_source_capped_for_the_demo_and_says_so() -> None:
    data = _load(None, seq_len=64, max_text_bytes=50_000)
    blocks = data.train.examples.get(range(len(data.train.examples)))
    assert all(ids == labels and len(ids) == 64 for ids, labels in blocks)
    text = ByteTokenizer().decode([i for ids, _ in blocks for i in ids])
    assert "def " in text and "import " in text
    assert 50_000 - 64 < data.summary["tokens"] <= 50_000 + 200  # whole lines, whole blocks
    assert "--max-text-bytes 50,000" in data.describe()
    data.close()
    demo = _load(None, seq_len=64)
    assert "the demo corpus' size 1,048,576" in demo.describe()
    demo.close()


def test_all_of_the_data_is_read_and_fingerprinted(tmp_path) -> None:
    # two files with the same first 300 KB: the old reader cut both at 1 MiB... here at 300 KB
    # of a cap, and without a cap it must read (and fingerprint) everything
    head = "the same beginning\n" * 16_000
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(head + "tail of file a\n" * 9_000)
    b.write_text(head + "b ends otherwise\n" * 5_000)
    da, db = _load(a), _load(b)
    assert da.summary["tokens"] == len(a.read_bytes()) // 16 * 16  # every whole block
    assert db.summary["tokens"] == len(b.read_bytes()) // 16 * 16
    assert da.fingerprint != db.fingerprint
    capped_a, capped_b = _load(a, max_text_bytes=300_000), _load(b, max_text_bytes=300_000)
    assert capped_a.fingerprint == capped_b.fingerprint  # the cap is what makes them equal
    assert "--max-text-bytes 300,000" in capped_a.describe()
    for d in (da, db, capped_a, capped_b):
        d.close()


def test_a_folder_is_read_in_sorted_order_hidden_files_skipped(tmp_path) -> None:
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.md").write_text("first\n")
    (tmp_path / ".hidden").write_text("never\n")
    data = _load(tmp_path, seq_len=4, batch_size=1)
    stream = bytes(data.train.examples.flat.to_pylist()).decode()
    assert stream == "first\nsecond\n"  # a.md, then b.txt; the stream is kept whole
    data.close()


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path) -> None:
    (tmp_path / "t.txt").write_text("".join(f"line {i}\n" for i in range(2000)))
    a, b = _load(tmp_path / "t.txt", batch_size=4), _load(tmp_path / "t.txt", batch_size=4)
    s3, again, s4 = a.train.step(3), b.train.step(3), a.train.step(4)
    assert torch.equal(s3[0].inputs["input_ids"], again[0].inputs["input_ids"])
    assert not torch.equal(s3[0].inputs["input_ids"], s4[0].inputs["input_ids"])
    assert s3[0].inputs["input_ids"].shape == (4, 16)
    assert torch.equal(s3[0].inputs["labels"], s3[0].inputs["input_ids"])
    # a later epoch is a new permutation of the same blocks
    per_epoch = len(a.train.examples) // 4
    first = {tuple(r) for s in range(per_epoch) for r in a.train.step(s)[0].inputs["input_ids"].tolist()}
    second = {tuple(r) for s in range(per_epoch, 2 * per_epoch)
              for r in a.train.step(s)[0].inputs["input_ids"].tolist()}
    assert first == second and a.train.step(0)[0].inputs["input_ids"].tolist() != \
        a.train.step(per_epoch)[0].inputs["input_ids"].tolist()
    a.close()
    b.close()


def test_bad_text_is_refused_with_file_and_line(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no training text"):
        _load(empty)
    (empty / "blank.txt").write_text("   \n")
    with pytest.raises(ValueError, match="no training text"):
        _load(empty)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first line\nsecond line\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 text \(line 3, byte offset 26"):
        _load(bad)
    (tmp_path / "short.txt").write_text("short")
    with pytest.raises(ValueError, match="smaller --seq-len"):
        _load(tmp_path / "short.txt", seq_len=64)
    with pytest.raises(ValueError, match="--format chat needs records"):
        _load(tmp_path / "short.txt", format="chat")


def test_a_killed_runs_data_cache_is_removed_by_the_next_run(tmp_path, monkeypatch) -> None:
    """Issue 28 item 3: kill -9 leaves a run's tokenized tables behind; the next run's cache
    removes them (owner files), never a live run's cache or a folder without an owner."""
    import os
    import subprocess
    import sys
    import tempfile

    from tightfit.train.data.sources import DataCache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import time; from tightfit.train.data.sources import DataCache; c = DataCache(); "
            "(c.dir / 'records.arrow').write_bytes(bytes(4096)); print(c.dir, flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        killed = Path(proc.stdout.readline().strip())
    finally:
        proc.kill()  # SIGKILL: no cleanup runs
        proc.wait()
    assert killed.parent == tmp_path and (killed / "records.arrow").is_file()
    unowned = tmp_path / "tightfit-data-older"  # an older version's, or one being made
    unowned.mkdir()
    live = DataCache()
    assert not killed.exists() and unowned.is_dir() and live.dir.is_dir()
    other = DataCache()  # a second run beside a live one leaves it alone
    assert live.dir.is_dir()
    for cache in (live, other):
        cache.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tightfit-data-older"]
