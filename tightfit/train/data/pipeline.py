"""``--data`` → :class:`TrainData`: read, check, tokenize, split, batch — every check first.

Every error names the file and, for records, the line or record, and says what to change;
it is raised before the run writes anything (the cache of tokenized tables is a temporary
folder, removed on any error and when the run ends).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tightfit.train.data.batches import Batcher
from tightfit.train.data.examples import Blocks, Examples, Records, split
from tightfit.train.data.records import (
    IGNORE,
    Recipe,
    RecordError,
    resolve_format,
    tokenize_records,
    tokenize_text,
    unused_columns,
)
from tightfit.train.data.sources import (
    DataCache,
    Source,
    find_source,
    load_records,
    load_text,
    locate,
    quiet_datasets,
)
from tightfit.train.data.tokenizer import Tokenizer
from tightfit.train.run_options import FORMAT_FIELDS, DataOptions

logger = logging.getLogger("tightfit.train.data")


@dataclass
class TrainData:
    """The run's data: the training and eval batches, what was read, fingerprints.

    Attributes:
        train: The training batches (``train.step(step)`` → the step's micro-batches).
        eval: The eval set's batches, or ``None`` without eval data.
        summary: Format, examples, tokens, trained tokens (targets), truncated and dropped
            records, for the log and ``report.json``.
        fingerprint: A hash of the training data's tokens (a resume checks it).
        eval_fingerprint: The same for ``--eval-data`` (``None`` otherwise).
    """

    train: Batcher
    eval: Batcher | None
    summary: dict[str, Any]
    fingerprint: str
    eval_fingerprint: str | None = None
    cache: DataCache | None = field(default=None, repr=False)

    def close(self) -> None:
        """Remove the tokenized tables (the run is over)."""
        if self.cache is not None:
            self.cache.close()

    def describe(self) -> str:
        """One line for the log: what is trained on, and the trained tokens."""
        s = self.summary
        text = (f"data: {s['note'] or s['where']} as {s['format']}: {s['examples']:,} examples, "
                f"{s['tokens']:,} tokens, {s['targets']:,} trained ({s['trained']})")
        if s["truncated"] or s["dropped"]:
            text += (f"; {s['truncated']} truncated to --seq-len, {s['dropped']} dropped "
                     "(nothing to train left after truncation)")
        if s.get("eval_examples"):
            text += f"; eval: {s['eval_examples']:,} examples ({s['eval_where']})"
        return text

    def epochs(self, steps: int) -> str:
        """How many passes over the training data ``steps`` steps make, for the log."""
        per = self.train.steps_per_epoch()
        return (f"{steps} steps are {steps / per:.3g} epochs of the data ({per} steps an "
                f"epoch of {self.summary['examples']:,} examples)")


def preview(examples: Examples, tok: Tokenizer, chars: int = 240) -> str:
    """The first example as text, the tokens the loss sees in [[...]] (its first ``chars``
    characters; line breaks shown as \\n): what "trained" means, seen once in the log."""
    ids, labels = examples.get([0])[0]
    trained = [False, *(y != IGNORE for y in labels[1:])]  # token i is label i's target
    parts, start, left = [], 0, chars
    for i in range(1, len(ids) + 1):
        if left > 0 and (i == len(ids) or trained[i] != trained[start]):
            text = tok.decode(ids[start:i]).replace("\n", "\\n")
            cut, left = text[:left], left - len(text)
            parts.append(f"[[{cut}]]" if trained[start] else cut)
            start = i
    more = " ..." if left < 0 else ""
    return f"example 1, trained tokens in [[...]]: {''.join(parts)}{more}"


def _trained(fmt: str, completion_only: bool) -> str:
    """Which tokens the loss sees, in the words of the data's format."""
    if fmt == "raw" or not completion_only:
        return "every token"
    return {"chat": "the assistant turns' tokens", "text": "every token"}.get(
        fmt, "the completions' tokens")


def load_train_data(opts: DataOptions, tok: Tokenizer, *, seq_len: int, batch_size: int,
                    grad_accum: int, seed: int, progress: bool = False) -> TrainData:
    """Read, check and tokenize ``--data`` (and ``--eval-data``) and batch it.

    Raises:
        ValueError / FileNotFoundError: bad data or options, named with file and record.
    """
    cache = DataCache()
    try:
        with quiet_datasets(progress):
            fmt, examples, note, fp, where = _read(opts.path, opts, tok, seq_len, cache)
            train, held, eval_fp, eval_where = examples, None, None, None
            if opts.eval_data is not None:
                eval_fmt, held, _, eval_fp, _ = _read(opts.eval_data, opts, tok, seq_len, cache)
                if eval_fmt != fmt:
                    raise ValueError(f"--eval-data {opts.eval_data!r} is {eval_fmt} data but "
                                     f"--data is {fmt}; give both in one format.")
                eval_where = repr(opts.eval_data)
            elif opts.eval_fraction:
                train, held = split(examples, opts.eval_fraction, seed)
                eval_where = f"--eval-fraction {opts.eval_fraction} of the data"
        _check_enough(train, fmt, seq_len, batch_size * grad_accum, opts)
        kw = {"batch_size": batch_size, "grad_accum": grad_accum, "seq_len": seq_len,
              "mode": opts.batching, "seed": seed, "pad_id": tok.pad_id}
        summary = {"format": fmt, "where": where, "note": note,
                   "examples": len(train), "tokens": int(train.lengths.sum()),
                   "targets": train.targets(), "truncated": examples.truncated,
                   "dropped": examples.dropped, "eval_examples": len(held) if held else 0,
                   "eval_where": eval_where, "batching": opts.batching,
                   "trained": _trained(fmt, opts.completion_only),
                   "preview": preview(train, tok)}
        return TrainData(Batcher(train, **kw), Batcher(held, **kw) if held else None,
                         summary, fp, eval_fp, cache)
    except BaseException:
        cache.close()
        raise


def _read(path: str | None, opts: DataOptions, tok: Tokenizer, seq_len: int,
          cache: DataCache) -> tuple[str, Examples, str, str, str]:
    """(format, examples, note, fingerprint, where) of one data path."""
    source = _as_requested(find_source(path), opts.format)
    if source.kind == "raw":
        lines, note = load_text(source, cache, opts.max_text_bytes)
        blocks = Blocks(tokenize_text(lines, tok, cache), seq_len)
        return "raw", blocks, note, blocks.fingerprint(), source.where
    if opts.max_text_bytes is not None:
        raise ValueError(f"--max-text-bytes caps plain text; {source.where} holds records "
                         "(select the records to train on in the file, or pass --format raw).")
    ds = load_records(source, cache)
    fmt = resolve_format(list(ds.column_names), opts.format, opts.field_map(), source.where)
    if fmt == "chat" and not tok.has_chat_template():
        raise ValueError(f"{source.where} holds chat messages but {tok.name} has no chat "
                         "template; pass --model with a chat model's folder (its "
                         "chat_template.jinja, or chat_template in tokenizer_config.json), "
                         "or give the data as prompt/completion records.")
    if opts.fields:
        _warn_unused(ds, fmt, opts, source.where)
    recipe = Recipe(fmt, opts.field_map(), seq_len, opts.too_long, opts.completion_only)
    try:
        table = tokenize_records(ds, recipe, tok, cache)
    except RecordError as exc:
        raise ValueError(f"{locate(source, exc.index, cache)}: the record {exc.problem}.") from None
    records = Records(table)
    return fmt, records, "", records.fingerprint(), source.where


def _warn_unused(ds: Any, fmt: str, opts: DataOptions, where: str) -> None:
    """Say which columns a ``--fields`` mapping leaves out that hold text (Alpaca's input
    under ``--fields prompt=instruction,completion=output``): they would not be trained on."""
    fields = opts.field_map()
    read = " and ".join(repr(fields[f]) for f in FORMAT_FIELDS[fmt] if fields[f] in ds.column_names)
    for column, full in unused_columns(ds, fmt, fields):
        fix = ("for Alpaca records (instruction and input as the prompt) drop --fields or pass "
               "--format alpaca" if fmt == "prompt-completion" and column == fields["input"]
               else "map it with --fields, or drop the column if it is not to be learned")
        logger.warning(f"column {column!r} of {where} holds text in {full:,} of {len(ds):,} "
                       f"records but is not trained on: --fields {opts.fields} reads {read} "
                       f"as {fmt}; {fix}.")


def _as_requested(source: Source, fmt: str) -> Source:
    """The source read as ``--format`` asks (``raw`` reads JSON/CSV files as plain text)."""
    if source.kind == "raw" and fmt not in ("auto", "raw"):
        raise ValueError(f"--format {fmt} needs records (JSON/JSONL/Parquet/CSV files or a "
                         f"save_to_disk folder); {source.where} holds plain text: drop "
                         "--format, or pass --format raw.")
    if source.kind == "records" and fmt == "raw":
        if source.builder in ("parquet", "disk"):
            raise ValueError(f"--format raw reads plain text files; {source.where} is "
                             f"{source.builder} data: pass --format text with its text column.")
        return Source("raw", "text", source.files, source.where)
    return source


def _check_enough(train: Examples, fmt: str, seq_len: int, per_step: int,
                  opts: DataOptions) -> None:
    if fmt == "raw" and len(train) == 0:
        raise ValueError(f"the data has {train.tokens() if isinstance(train, Blocks) else 0} "
                         f"tokens, fewer than one sequence of {seq_len}; pass more text with "
                         "--data or a smaller --seq-len.")
    if len(train) == 0:
        raise ValueError("no example is left to train on (all dropped after truncation); "
                         "pass a larger --seq-len.")
    if opts.batching == "bucket" and len(train) < per_step:
        raise ValueError(f"the training data has {len(train)} examples, fewer than one step's "
                         f"--batch-size x --grad-accum = {per_step}; pass more data, a smaller "
                         "--batch-size or --grad-accum, or --batching pack.")
