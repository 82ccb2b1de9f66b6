"""Training text → token ids → batches, with nothing downloaded.

* The default corpus is the Python standard library's own source files on this machine
  (found through ``sysconfig``), read in sorted order so every machine with the same Python
  builds the same corpus.
* ``--data FILE|DIR`` takes any text: a file, or every UTF-8 text file under a folder.
* Tokens come from a byte-level tokenizer (256 ids, one per byte) for the built-in model, or
  from the model folder's own Hugging Face tokenizer.

Batches are a pure function of ``(seed, step)``: a run resumed at step k sees exactly the
batches the uninterrupted run saw, with no sampler state to save.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

# Bytes of stdlib source read for the default corpus: plenty for a short demo run.
DEFAULT_CORPUS_BYTES = 1 << 20


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 sequences replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer (the model folder's), behind the same two methods."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def has_hf_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether a model folder ships tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((Path(folder) / n).is_file() for n in names)


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted order (the default corpus), lazily:
    the top-level modules come first, so a small corpus never walks the whole tree."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _text_files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for p in sorted(path.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts):
            yield p


def read_corpus(path: str | os.PathLike[str] | None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """Read training text.

    Args:
        path: A text file, a folder of text files (binary files are skipped), or ``None``
            for the Python standard library's source files.
        max_bytes: Stop after this many bytes of text.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: No text was found.
    """
    if path is None:
        files, where = stdlib_files(), f"the Python standard library ({sysconfig.get_paths()['stdlib']})"
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"data path {str(p)!r} does not exist; pass a text file or folder.")
        files, where = _text_files(p), repr(str(p))
    parts: list[str] = []
    total = 0
    for f in files:
        try:
            raw = f.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or unreadable: not training text
        if "\x00" in text or not text.strip():
            continue
        parts.append(text)
        total += len(raw)
        if total >= max_bytes:
            break
    corpus = "\n".join(parts)
    if len(corpus) > max_bytes:
        corpus = corpus[:max_bytes]
    if not corpus.strip():
        raise ValueError(
            f"no training text found in {where}; pass --data with a non-empty UTF-8 text file "
            "or a folder that contains some."
        )
    return corpus


@dataclass
class TokenData:
    """A corpus as one long tensor of token ids, cut into random windows per step.

    Attributes:
        tokens: 1-D ``int64`` token ids.
        fingerprint: Hash of the token ids (a resumed run checks it is the same data).
    """

    tokens: torch.Tensor
    fingerprint: str

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer) -> TokenData:
        """Tokenize ``text`` once."""
        if isinstance(tokenizer, ByteTokenizer):  # same ids, without a Python list of them
            raw = bytearray(text.encode("utf-8"))
            ids = torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64)
        else:
            ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        return cls(ids, digest)

    def check_fits(self, seq_len: int) -> None:
        """Raise ``ValueError`` when the corpus is shorter than one training window."""
        if self.tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the data has {self.tokens.numel()} tokens, fewer than one sequence of "
                f"{seq_len} + 1; pass more text with --data or a smaller --seq-len."
            )

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """The batch of training step ``step``: ``input_ids`` and ``labels`` (same ids; the
        model shifts them), a pure function of ``(seed, step)``."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - seq_len, (batch_size,), generator=g)
        ids = torch.stack([self.tokens[s : s + seq_len] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}
