"""Tokenizers behind one small interface: UTF-8 bytes for the built-in model (or
``--tokenizer bytes``), else a Hugging Face tokenizer, the model folder's own (or
``--tokenizer DIR``), its chat template included. A model folder without tokenizer files is
refused rather than read as bytes.

Chat rendering is the tokenizer's: ``apply_chat_template`` renders the conversation; the
assistant turns are found with the template's ``{% generation %}`` markers when it has them
(transformers' ``return_assistant_tokens_mask``), else as the text each assistant turn adds
to the rendering of the turns before it (rendered with ``add_generation_prompt=True``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' assistant markers


class ChatError(ValueError):
    """A conversation the tokenizer cannot render (the message says why and what to do)."""


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int | None
    name: str

    def encode_batch(self, texts: Sequence[str], *, special: bool) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def has_chat_template(self) -> bool: ...

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: no vocabulary file, nothing to download."""

    vocab_size = 256
    pad_id = 0  # any id: padded positions are masked out of attention and loss
    eos_id: int | None = None
    name = "the built-in byte tokenizer"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], *, special: bool) -> list[list[int]]:
        """Token ids of each text (bytes have no special tokens)."""
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 sequences replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def has_chat_template(self) -> bool:
        return False

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        raise ChatError(f"{self.name} has no chat template")


class HFTokenizer:
    """A local Hugging Face tokenizer (the model folder's), behind the same methods."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        pad = self.hf.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_id or 0))
        self.name = f"the tokenizer of {str(folder)!r}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str], *, special: bool) -> list[list[int]]:
        """Token ids of each text; ``special`` adds the tokenizer's own (a BOS, say)."""
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=special)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per token, whether an assistant wrote it.

        Raises:
            ChatError: the template cannot render the conversation, or renders a turn other
                than as an extension of the turns before it (and has no generation markers).
        """
        if _GENERATION_TAG.search(self.hf.chat_template or ""):
            enc = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ChatError(
                    "the chat template does not render each turn as an extension of the turns "
                    "before it, so the assistant's tokens cannot be told apart; use a template "
                    "with {% generation %} markers, or --no-completion-only")
            spans.append((len(before), len(upto)))
        if not getattr(self.hf, "is_fast", False):
            raise ChatError(f"{self.name} is a slow tokenizer: telling the assistant's tokens "
                            "apart needs a fast one (tokenizer.json) or {% generation %} "
                            "markers in the template; or pass --no-completion-only")
        enc = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raises its own types (raise_exception in templates)
            raise ChatError(f"the chat template refused the conversation: {exc}") from exc


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTES = "bytes"  # --tokenizer bytes: UTF-8 bytes as ids 0..255, the built-in model's tokenizer


def has_hf_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether a folder holds tokenizer files (what ``tokenizer.save_pretrained`` writes)."""
    return any((Path(folder) / n).is_file() for n in TOKENIZER_FILES)


def tokenizer_folder(model: str | None, tokenizer: str | None) -> str | None:
    """The folder a run's tokenizer is read from (``None``: bytes)."""
    if tokenizer == BYTES:
        return None
    return tokenizer if tokenizer is not None else model


def check_tokenizer(model: str | None, tokenizer: str | None = None) -> str | None:
    """The folder a run's tokenizer will be read from (``None``: bytes), checked: ``--tokenizer``
    (a folder, or ``bytes``), else the model folder's own; bytes for the built-in model
    (``model`` ``None``). Reads no file: ``tightfit train`` calls it before its heavy imports.

    Raises:
        FileNotFoundError: the folder has no tokenizer files (a model folder never silently
            trains on bytes: ids 0..255 mean nothing to a model that has its own vocabulary).
    """
    folder = tokenizer_folder(model, tokenizer)
    if folder is None or has_hf_tokenizer(folder):
        return folder
    files = ", ".join(TOKENIZER_FILES[:2])
    if tokenizer is not None:
        what = "does not exist" if not Path(folder).exists() else f"has no tokenizer ({files})"
        raise FileNotFoundError(f"--tokenizer {folder!r} {what}; pass a folder written by "
                                "tokenizer.save_pretrained, or --tokenizer bytes.")
    raise FileNotFoundError(
        f"model folder {folder!r} has no tokenizer ({files}, ...); save the model's tokenizer "
        f"into it with tokenizer.save_pretrained({folder!r}), or pass --tokenizer DIR (or "
        "--tokenizer bytes to train on UTF-8 bytes).")


def load_tokenizer(model: str | None, tokenizer: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a run (:func:`check_tokenizer` says which, and raises as it does)."""
    folder = check_tokenizer(model, tokenizer)
    return ByteTokenizer() if folder is None else HFTokenizer(folder)
