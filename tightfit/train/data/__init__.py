"""Training data for ``tightfit train``, through ``datasets`` (Arrow, memory-mapped).

Modules, in the order data flows:
    sources: what ``--data`` is (plain text, JSON/JSONL/Parquet/CSV records, a save_to_disk
        folder, the stdlib demo corpus) and reading it; the run's temporary cache.
    tokenizer: bytes for the built-in model (or --tokenizer bytes), else the model folder's
        tokenizer (or --tokenizer DIR) and chat template; a folder without one is refused.
    records: records → token ids and labels (completion-only / assistant-only masking,
        truncation), plain text → a token stream.
    examples: the tokenized rows (records, or ``--seq-len`` blocks of the stream); eval split.
    batches: each step's micro-batches, a pure function of (seed, step): by length
        (``bucket``) or packed with per-example positions (``pack``).
    pipeline: ``load_train_data(options, tokenizer, ...)`` → :class:`TrainData`, every check first.
"""

from tightfit.train.data.batches import Batcher, MicroBatch
from tightfit.train.data.pipeline import TrainData, load_train_data
from tightfit.train.data.sources import DEFAULT_CORPUS_BYTES, stdlib_files
from tightfit.train.data.tokenizer import (
           ByteTokenizer,
           HFTokenizer,
           has_hf_tokenizer,
           load_tokenizer,
           tokenizer_folder,
)

__all__ = ["DEFAULT_CORPUS_BYTES", "Batcher", "ByteTokenizer", "HFTokenizer", "MicroBatch",
           "TrainData", "has_hf_tokenizer", "load_tokenizer", "load_train_data", "stdlib_files",
           "tokenizer_folder"]
