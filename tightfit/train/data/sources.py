"""Where training data comes from, read through ``datasets`` (Arrow, memory-mapped).

* plain text: a file or a folder of them, read with datasets' ``text`` builder line by line
  (line breaks kept), all of it unless ``--max-text-bytes`` caps it (printed);
* records: JSON / JSON Lines / Parquet / CSV files (or a folder of one kind), read with the
  builder of that name, or a folder written by ``Dataset.save_to_disk``;
* the default: the Python standard library's source files on this machine (``sysconfig``),
  sorted, the first MiB (the built-in demo's corpus).

Everything datasets writes (its Arrow cache, our tokenized tables) goes to a
:class:`DataCache`, a temporary folder removed when the run ends (or, for a killed run, by the
next one), never into the data folder or ``~/.cache``. Errors name the file and, for records,
the line or record.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tightfit.integrity.owners import remove_stale, write_owner

DATA_PREFIX = "tightfit-data-"  # the temporary folder of a run's data (DataCache)
# Bytes of stdlib source read for the default corpus: plenty for a short demo run.
DEFAULT_CORPUS_BYTES = 1 << 20
RECORD_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_DISK_MARKERS = ("state.json", "dataset_dict.json")


class DataCache:
    """A temporary folder for everything datasets writes during one run (removed by ``close``).

    The folder gets an owner file (:mod:`tightfit.integrity.owners`) the moment it is made, and
    a new cache first removes the caches of runs whose process is gone (``kill -9``, the OOM
    killer): a run killed before it could clean up leaves its tokenized tables only until the
    next run on the machine. Folders without an owner file are never touched.
    """

    def __init__(self) -> None:
        parent = tempfile.gettempdir()
        remove_stale(parent, DATA_PREFIX)
        self._tmp = tempfile.TemporaryDirectory(prefix=DATA_PREFIX, dir=parent,
                                                ignore_cleanup_errors=True)
        self.dir = Path(self._tmp.name)
        write_owner(str(self.dir))
        self._count = 0

    def file(self, name: str) -> str:
        """A fresh file name in the cache for a table called ``name``."""
        self._count += 1
        return str(self.dir / f"{self._count:03d}-{name}.arrow")

    def close(self) -> None:
        self._tmp.cleanup()


@dataclass(frozen=True)
class Source:
    """A resolved ``--data`` path.

    Attributes:
        kind: ``raw`` (plain text) or ``records``.
        builder: datasets' builder (``text``, ``json``, ``parquet``, ``csv``) or ``disk``
            (``load_from_disk``) or ``stdlib`` (the demo corpus, plain text).
        files: The files read, in order (the folder itself for ``disk``).
        where: How messages name it.
    """

    kind: Literal["raw", "records"]
    builder: str
    files: tuple[Path, ...]
    where: str


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted order (the default corpus), lazily:
    the top-level modules come first, so a small corpus never walks the whole tree."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def find_source(path: str | None, flag: str = "--data") -> Source:
    """Resolve ``--data`` to a :class:`Source` (by file type; the columns decide the format).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an empty folder or file, or a folder that mixes record files and other
            files (``flag`` names the option in the message).
    """
    if path is None:
        where = f"the Python standard library ({sysconfig.get_paths()['stdlib']})"
        return Source("raw", "stdlib", (), where)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist; pass a text file or "
                                "folder, a JSON/JSONL/Parquet/CSV file or a save_to_disk folder.")
    if p.is_dir() and any((p / m).is_file() for m in _DISK_MARKERS):
        return Source("records", "disk", (p,), repr(str(p)))
    files = (p,) if p.is_file() else tuple(
        f for f in sorted(p.rglob("*"))
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not files:
        raise ValueError(f"no training text found in {str(p)!r}: the folder has no files; "
                         "pass --data with a non-empty file or folder.")
    if all(f.stat().st_size == 0 for f in files):
        what = "is an empty file" if p.is_file() else "holds only empty files"
        raise ValueError(f"{flag} {str(p)!r} {what}; pass {flag} with the text or records "
                         "to train on.")
    builders = {RECORD_BUILDERS.get(f.suffix.lower()) for f in files}
    if builders == {None}:
        return Source("raw", "text", files, repr(str(p)))
    if len(builders) > 1:
        kinds = sorted({f.suffix or f.name for f in files})
        raise ValueError(f"data folder {str(p)!r} mixes file types ({', '.join(kinds[:6])}); "
                         "pass a folder of plain text files, or of one record format.")
    return Source("records", builders.pop(), files, repr(str(p)))


@contextlib.contextmanager
def quiet_datasets(progress: bool) -> Iterator[None]:
    """datasets' progress bars off inside unless ``progress`` (the state before comes back)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def load_text(source: Source, cache: DataCache, max_bytes: int | None) -> tuple[Any, str]:
    """Plain text as a ``datasets.Dataset`` of lines (column ``text``, line breaks kept).

    Returns:
        The lines, and a note saying what was read (and what a cap left out).

    Raises:
        ValueError: a file that is not UTF-8 (named, with its line), or no text at all.
    """
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    demo_cap = source.builder == "stdlib" and max_bytes is None
    if source.builder == "stdlib":
        max_bytes = max_bytes or DEFAULT_CORPUS_BYTES
        files = _stdlib_corpus(max_bytes)
    else:
        files = _first_files(list(source.files), max_bytes)
    try:
        with quiet_datasets(False):  # its "Downloading data" bar: local files, no network
            lines = load_dataset("text", data_files=[str(f) for f in files], split="train",
                                 cache_dir=str(cache.dir), sample_by="line",
                                 keep_linebreaks=True)
    except DatasetGenerationError as exc:
        if isinstance(exc.__cause__, UnicodeDecodeError):
            raise ValueError(_not_utf8(files)) from None
        raise
    total = sum(f.stat().st_size for f in files)
    note = f"{len(files)} text file(s) from {source.where}, {total:,} bytes"
    if max_bytes is not None:
        keep, used = _lines_within(lines, max_bytes)
        lines = lines.select(range(keep))
        cap = "the demo corpus' size" if demo_cap else "--max-text-bytes"
        note = (f"the first {used:,} bytes of {source.where} ({cap} {max_bytes:,}, whole lines)")
    if not any(t.strip() for batch in lines.iter(batch_size=10_000) for t in batch["text"]):
        raise ValueError(f"no training text found in {source.where}; pass --data with a "
                         "non-empty UTF-8 text file or a folder that contains some.")
    return lines, note


def _lines_within(lines: Any, max_bytes: int) -> tuple[int, int]:
    """How many leading lines reach ``max_bytes`` of UTF-8 (the crossing line included)."""
    keep = used = 0
    for batch in lines.iter(batch_size=10_000):
        for text in batch["text"]:
            if used >= max_bytes:
                return keep, used
            used, keep = used + len(text.encode("utf-8")), keep + 1
    return keep, used


def _first_files(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The files that hold the first ``max_bytes`` (all of them without a cap)."""
    if max_bytes is None:
        return files
    out, total = [], 0
    for f in files:
        out.append(f)
        total += f.stat().st_size
        if total >= max_bytes:
            break
    return out


def _stdlib_corpus(max_bytes: int) -> list[Path]:
    """Stdlib files, UTF-8 and non-empty, until ``max_bytes`` (our corpus: skip, not refuse)."""
    out, total = [], 0
    for f in stdlib_files():
        try:
            text = f.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\x00" in text or not text.strip():
            continue
        out.append(f)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return out


def _not_utf8(files: list[Path]) -> str:
    """The message for the first of ``files`` that is not UTF-8: file, line and byte."""
    for f in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        line, offset = 1, 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    bad = offset + exc.start
                    line += chunk[: exc.start].count(b"\n")
                    return (f"data file {str(f)!r} is not UTF-8 text (line {line}, byte "
                            f"offset {bad}: {exc.reason}); convert it to UTF-8 or move it out "
                            "of the data.")
                line += chunk.count(b"\n")
                offset += len(chunk)
    return "a data file is not UTF-8 text; convert it to UTF-8."


def load_records(source: Source, cache: DataCache) -> Any:
    """Records as a ``datasets.Dataset`` (JSON/JSONL/Parquet/CSV files, or a save_to_disk folder).

    Raises:
        ValueError: a file datasets cannot read (named, with datasets' reason), or a
            save_to_disk folder of several splits without a ``train`` split.
    """
    from datasets import DatasetDict, load_dataset, load_from_disk
    from datasets.exceptions import DatasetGenerationError

    if source.builder == "disk":
        ds = load_from_disk(str(source.files[0]))
        if isinstance(ds, DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{source.where} holds splits {sorted(ds)} but no 'train'; "
                                 "save the training split, or pass the split's folder.")
            ds = ds["train"]
        return ds
    try:
        with quiet_datasets(False), _no_datasets_errors():  # ours say it, once
            return load_dataset(source.builder, data_files=[str(f) for f in source.files],
                                split="train", cache_dir=str(cache.dir))
    except DatasetGenerationError as failed:
        raise ValueError(_bad_file(source, cache, failed)) from None


def _bad_file(source: Source, cache: DataCache, failed: Exception) -> str:
    """The message for records datasets cannot read: the file, and its line when we find it."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    kind = _KIND[source.builder]
    if source.builder == "json":
        for f in source.files:
            problem = _json_problem(f)
            if problem is not None:
                return f"data file {str(f)!r} is not valid {kind}: {problem}; fix the file."
    for f in source.files if len(source.files) > 1 else ():  # which file fails, and why
        try:
            with quiet_datasets(False), _no_datasets_errors():
                load_dataset(source.builder, data_files=[str(f)], split="train",
                             cache_dir=str(cache.dir))
        except DatasetGenerationError as exc:
            failed = exc
            break
    else:
        f = source.files[0]
    # datasets' "in row N" counts from 0 within a block of the file: no line to go by
    reason = re.sub(r"\s+in row \d+", "", str(failed.__cause__ or failed))
    also = "; or pass --format raw to train on its lines as plain text" if kind == "CSV" else ""
    return f"data file {str(f)!r} is not valid {kind} ({reason}); fix the file{also}."


def _json_problem(path: Path) -> str | None:
    """Where a JSON / JSON Lines file first fails to parse (``line N, column C: reason``), or
    ``None`` when every line parses (or the whole file, for a file that is one document)."""
    with open(path, "rb") as fh:
        first = True
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                json.loads(raw.rstrip(b"\r\n"))
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                if first:
                    break  # not one record per line: a document over several lines
                return f"line {number}{_json_reason(exc)}"
            first = False
        else:
            return None
    try:
        with open(path, "rb") as fh:
            json.load(fh)
    except ValueError as exc:
        at = f"line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "the file"
        return at + _json_reason(exc)
    return None


def _json_reason(exc: ValueError) -> str:
    """``, column C: what json says`` (or that it is not UTF-8), to follow a line number."""
    if isinstance(exc, json.JSONDecodeError):
        return f", column {exc.colno}: {exc.msg.removesuffix(' at')}"  # "... at" a position
    return f": not UTF-8 text ({exc})"


@contextlib.contextmanager
def _no_datasets_errors() -> Iterator[None]:
    """datasets' own logged errors off inside: the error we raise says what failed, once."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.get_verbosity()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(was)


_KIND = {"json": "JSON / JSON Lines", "parquet": "Parquet", "csv": "CSV"}


def locate(source: Source, index: int, cache: DataCache) -> str:
    """Name record ``index`` (0-based, over all files) as ``file, line N`` / ``record N``."""
    if source.builder == "disk":
        return f"{source.where}, record {index + 1}"
    from datasets import load_dataset

    start = 0
    for f in source.files:
        with quiet_datasets(False):
            n = len(load_dataset(source.builder, data_files=[str(f)], split="train",
                                 cache_dir=str(cache.dir))) if len(source.files) > 1 else 1 << 62
        if index < start + n:
            k = index - start
            line = _jsonl_line(f, k) if f.suffix.lower() == ".jsonl" else None
            return f"{str(f)!r}, " + (f"line {line}" if line else f"record {k + 1}")
        start += n
    return f"{source.where}, record {index + 1}"


def _jsonl_line(path: Path, k: int) -> int | None:
    """Line number of the ``k``-th record of a JSON Lines file (blank lines are no records)."""
    seen = -1
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.strip():
                seen += 1
                if seen == k:
                    return number
    return None
