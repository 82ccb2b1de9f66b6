"""Records → examples: token ids and labels, the loss only on what should be learned.

* ``text``: one example per record, every token trained (BOS as the tokenizer adds it, EOS
  appended when it has one);
* ``prompt-completion``: prompt tokens (with the tokenizer's own special tokens) then
  completion tokens and EOS; with ``completion_only`` the prompt's labels are -100;
* ``alpaca``: ``instruction``, ``input`` (optional, may be empty) and ``output``, as
  prompt-completion with the instruction (and the input, when it has text) in the Alpaca
  prompt layout as the prompt and the output as the completion;
* ``chat``: ``messages`` rendered by the model's chat template; with ``completion_only``
  only the assistants' tokens are trained.

A record longer than ``--seq-len`` is truncated (counted) or refused; one left with no trained
token after truncation is dropped (counted). Plain text is tokenized line by line into one
stream (:func:`tokenize_text`); :mod:`tightfit.train.data.examples` cuts it into blocks.
Tokenizing is ``Dataset.map`` into Arrow tables in the run's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tightfit.train.data.sources import DataCache
from tightfit.train.data.tokenizer import ChatError, Tokenizer
from tightfit.train.run_options import FORMAT_FIELDS

IGNORE = -100  # the label transformers' losses skip
OPTIONAL = frozenset({"input"})  # fields a format reads when their column is there
# The Stanford Alpaca prompt (tatsu-lab/stanford_alpaca's PROMPT_DICT) with alpaca-lora's
# newline after "### Response:", so the output's tokens start on a line of their own.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that "
                 "provides further context. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
                 "### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response "
                          "that appropriately completes the request.\n\n### Instruction:\n"
                          "{instruction}\n\n### Response:\n")
KEEP, TRUNCATED, DROPPED = 0, 1, 2
_ROLES = ("system", "user", "assistant", "tool")


class RecordError(ValueError):
    """Record ``index`` (0-based, over the whole dataset) is bad; ``problem`` says how."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index, self.problem = index, problem


@dataclass(frozen=True)
class Recipe:
    """How records become examples."""

    format: str
    fields: dict[str, str]
    seq_len: int
    too_long: str
    completion_only: bool


def resolve_format(columns: list[str], fmt: str, fields: dict[str, str], where: str) -> str:
    """The record format of a dataset with ``columns`` (``fmt`` checked, or ``auto`` decided).

    Raises:
        ValueError: the columns a format needs are missing, or several formats fit.
    """
    def needs(name: str) -> list[str]:  # an optional field is needed once --fields maps it
        return [f for f in FORMAT_FIELDS[name] if f not in OPTIONAL or fields[f] != f]

    def fits(name: str) -> bool:
        return all(fields[f] in columns for f in needs(name))

    if fmt != "auto":
        if not fits(fmt):
            need = [fields[f] for f in needs(fmt)]
            missing = [c for c in need if c not in columns]
            name = next(f for f in needs(fmt) if fields[f] in missing)
            raise ValueError(f"{where} has no column {missing} for --format {fmt}; its columns "
                             f"are {columns}; map yours with --fields {name}=COLUMN.")
        return fmt
    found = [name for name in ("chat", "prompt-completion", "alpaca", "text") if fits(name)]
    mapped = {name for name, column in fields.items() if name != column}
    if len(found) > 1 and mapped:  # --fields names the format it maps for
        found = [name for name in found if mapped & set(FORMAT_FIELDS[name])] or found
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{where} has columns for several formats ({', '.join(found)}); pass "
                         "--format to choose one.")
    raise ValueError(f"{where} has columns {columns}, none of a record format: 'text', "
                     "'prompt' + 'completion', 'instruction' + 'output' (Alpaca, 'input' too "
                     "when it has one) or 'messages'; map yours with --fields (e.g. --fields "
                     "prompt=question,completion=answer) or pass --format raw to train on the "
                     "file's text as it is.")


def unused_columns(ds: Any, fmt: str, fields: dict[str, str]) -> list[tuple[str, int]]:
    """Columns named like a record field that ``fmt`` does not read, with the number of
    records in which they hold text (the ones with none left out): what a ``--fields`` mapping
    for another format's data would silently drop (Alpaca's ``input``)."""
    read = {fields[f] for f in FORMAT_FIELDS[fmt]}
    named = {c for names in FORMAT_FIELDS.values() for c in (*names, *(fields[n] for n in names))}
    out = []
    for column in ds.column_names:
        if column in read or column not in named:
            continue
        full = sum(isinstance(v, str) and bool(v.strip())
                   for batch in ds.select_columns([column]).iter(batch_size=10_000)
                   for v in batch[column])
        if full:
            out.append((column, full))
    return out


def tokenize_records(ds: Any, recipe: Recipe, tok: Tokenizer, cache: DataCache) -> Any:
    """``ds`` as examples: columns ``input_ids``, ``labels``, ``length``, ``targets``, ``cut``.

    ``targets`` counts the labels the loss sees (after the shift: every position but the
    first); ``cut`` is ``KEEP``, ``TRUNCATED`` or ``DROPPED`` (no target left).

    Raises:
        RecordError: a record without the fields, with an empty prompt or completion, a chat
            without an assistant turn or that the template cannot render, or one longer
            than ``--seq-len`` when ``too_long`` is ``refuse``.
    """
    from datasets import Features, List, Value

    features = Features({"input_ids": List(Value("int32")), "labels": List(Value("int32")),
                         "length": Value("int32"), "targets": Value("int32"),
                         "cut": Value("int8")})  # fmt: skip

    def batch_fn(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        pairs = _encode(batch, indices, recipe, tok)
        out: dict[str, list[Any]] = {k: [] for k in features}
        for index, (ids, labels) in zip(indices, pairs):
            ids, labels, cut = _fit(index, ids, labels, recipe)
            targets = sum(1 for lab in labels[1:] if lab != IGNORE)
            for k, v in zip(features, (ids, labels, len(ids), targets,
                                       cut if targets else DROPPED)):
                out[k].append(v)
        return out

    return ds.map(batch_fn, batched=True, with_indices=True, remove_columns=ds.column_names,
                  features=features, cache_file_name=cache.file("records"),
                  desc="tokenizing records")


def tokenize_text(lines: Any, tok: Tokenizer, cache: DataCache) -> Any:
    """Plain-text lines as token ids (column ``input_ids``), no special tokens."""
    from datasets import Features, List, Value

    return lines.map(lambda b: {"input_ids": tok.encode_batch(b["text"], special=False)},
                     batched=True, remove_columns=lines.column_names,
                     features=Features({"input_ids": List(Value("int32"))}),
                     cache_file_name=cache.file("text"), desc="tokenizing text")


def _encode(batch: dict[str, list[Any]], indices: list[int], recipe: Recipe,
            tok: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each record of a batch, before any truncation."""
    f = recipe.fields
    eos = [] if tok.eos_id is None else [tok.eos_id]
    if recipe.format == "chat":
        return [_chat(i, m, recipe.completion_only, tok) for i, m in zip(indices, batch[f["messages"]])]
    if recipe.format == "text":
        texts = [_string(i, t, f["text"], "text") for i, t in zip(indices, batch[f["text"]])]
        return [(ids + eos, ids + eos) for ids in tok.encode_batch(texts, special=True)]
    if recipe.format == "alpaca":
        prompts = _alpaca_prompts(batch, indices, f)
        completions = [_string(i, t, f["output"], "output")
                       for i, t in zip(indices, batch[f["output"]])]
    else:
        prompts = [_string(i, t, f["prompt"], "prompt")
                   for i, t in zip(indices, batch[f["prompt"]])]
        completions = [_string(i, t, f["completion"], "completion")
                       for i, t in zip(indices, batch[f["completion"]])]
    out = []
    for p, c in zip(tok.encode_batch(prompts, special=True),
                    tok.encode_batch(completions, special=False)):
        ids = p + c + eos
        masked = [IGNORE] * len(p) if recipe.completion_only else p
        out.append((ids, masked + c + eos))
    return out


def _alpaca_prompts(batch: dict[str, list[Any]], indices: list[int],
                    f: dict[str, str]) -> list[str]:
    """Each record's instruction (and input, when it has text) in the Alpaca layout."""
    inputs = batch.get(f["input"], [None] * len(indices))
    out = []
    for i, instruction, extra in zip(indices, batch[f["instruction"]], inputs):
        instruction = _string(i, instruction, f["instruction"], "instruction")
        if extra is not None and not isinstance(extra, str):
            raise RecordError(i, f"has a {type(extra).__name__} in {f['input']!r}, not text")
        if extra and extra.strip():
            out.append(ALPACA_PROMPT.format(instruction=instruction, input=extra))
        else:
            out.append(ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
    return out


def _string(index: int, value: Any, column: str, name: str) -> str:
    named = repr(column) if column == name else f"{column!r} ({name})"
    if value is None:
        raise RecordError(index, f"has no {named} field")
    if not isinstance(value, str):
        raise RecordError(index, f"has a {type(value).__name__} in {named}, not text")
    if not value.strip():
        raise RecordError(index, f"has an empty {named} field")
    return value


def _chat(index: int, messages: Any, completion_only: bool,
          tok: Tokenizer) -> tuple[list[int], list[int]]:
    if not isinstance(messages, list) or not messages:
        raise RecordError(index, "has no messages (a list of {'role', 'content'} turns)")
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str) \
                or turn.get("role") not in _ROLES:
            raise RecordError(index, f"has a turn that is not {{'role': one of {list(_ROLES)}, "
                                     f"'content': text}}: {str(turn)[:80]}")
    clean = [{"role": t["role"], "content": t["content"]} for t in messages]
    if not any(t["role"] == "assistant" and t["content"].strip() for t in clean):
        raise RecordError(index, "has no assistant turn with content: nothing to learn")
    try:
        ids, mask = tok.render_chat(clean)
    except ChatError as exc:
        raise RecordError(index, str(exc)) from None
    if not completion_only:
        return ids, list(ids)
    return ids, [i if m else IGNORE for i, m in zip(ids, mask)]


def _fit(index: int, ids: list[int], labels: list[int],
         recipe: Recipe) -> tuple[list[int], list[int], int]:
    """The example within ``--seq-len``: as it is, truncated, or refused."""
    if len(ids) <= recipe.seq_len:
        return ids, labels, KEEP
    if recipe.too_long == "refuse":
        raise RecordError(index, f"has {len(ids)} tokens, more than --seq-len "
                                 f"{recipe.seq_len}; pass a larger --seq-len, or --too-long "
                                 "truncate to cut such records")
    return ids[: recipe.seq_len], labels[: recipe.seq_len], TRUNCATED
