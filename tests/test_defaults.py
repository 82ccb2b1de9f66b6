"""Every public default is defined once: the dataclasses hold it, and the Python API, both
commands' flags and the docs read it from there.

``tightfit train``'s flags are generated from :class:`~tightfit.train.run_options.RunConfig`
(whose groups are the API's own option classes), ``tightfit.prepare`` and
``tightfit.optimizer_for`` take those classes, and ``tightfit plan`` / ``tightfit.plan()``
take their LoRA and dtype defaults from them too. docs/train.md's option table states each
default; a change to a default that forgets the docs fails here.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from tightfit.cli import build_parser
from tightfit.qlora.prepare import prepare
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.train.run_options import RunConfig, flag_name
from tightfit.train.train_command import _option_keys, config_from_args

DOCS = Path(__file__).resolve().parents[1] / "docs"

# A default that is "not set" reads as one of these in the docs, by what it then means.
UNSET = {"none", "auto", "all", "built-in", "stdlib source", "pager's", "temp folder", ""}


def _train_defaults() -> dict[str, object]:
    return {flag_name(key): default for key, _, default in _option_keys()}


def test_train_flags_default_to_the_option_classes() -> None:
    args = build_parser("train").parse_args(["train"])
    assert config_from_args(args) == RunConfig()
    run = RunConfig()
    assert run.lora == LoraOptions() and run.prepare == PrepareOptions()


def test_prepare_keywords_are_the_prepare_options_fields() -> None:
    # prepare() has no defaults of its own: every option is a PrepareOptions field
    params = inspect.signature(prepare).parameters
    assert [p for p in params if p not in ("model_or_path", "options", "lora", "example",
                                           "device", "overrides")] == []
    with pytest.raises(TypeError, match="unknown prepare option"):
        PrepareOptions.merged(None, {"lora_r": 8})
    with pytest.raises(ValueError, match=r"checkpoint='none' \(options has 'budget'\)"):
        PrepareOptions.merged(PrepareOptions(), {"checkpoint": "none"})
    same = PrepareOptions(compute_dtype="bfloat16")
    assert PrepareOptions.merged(same, {"compute_dtype": "bf16"}) is same  # one spelling


def _doc_rows(text: str) -> dict[str, str]:
    """``{flag: its default as the docs write it}`` from the option table of docs/train.md."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = [re.sub(r"\[no-\]", "", f) for f in re.findall(r"`(--[\w\[\]-]+)", cells[0])]
        values = [v.strip().strip("`") for v in cells[1].split(",")] if cells[1] else [""]
        if len(values) == 1:
            values *= len(flags)
        assert len(values) == len(flags), f"docs/train.md row {cells[0]}: {cells[1]!r}"
        out.update(zip(flags, values, strict=True))
    return out


def _reads_as(doc: str, default: object) -> bool:
    if default is None:
        return doc in UNSET or doc.startswith("new ")
    if isinstance(default, bool):
        return doc == ("on" if default else "off")
    if isinstance(default, int | float):
        try:
            return float(doc) == float(default)
        except ValueError:
            return False
    return doc == str(default)


def test_docs_state_every_train_default() -> None:
    docs = _doc_rows((DOCS / "train.md").read_text())
    defaults = _train_defaults()
    assert sorted(set(defaults) - set(docs)) == [], "flags missing from docs/train.md's table"
    assert sorted(set(docs) - set(defaults)) == [], "docs/train.md names flags that do not exist"
    wrong = {f: (docs[f], d) for f, d in defaults.items() if not _reads_as(docs[f], d)}
    assert wrong == {}, "docs/train.md says (docs, code)"


def test_the_docs_checker_can_fail() -> None:
    rows = _doc_rows("| `--lora-r`, `--lora-dropout` | 8, 0.05 | adapters |\n"
                     "| `--[no-]double-quant` | off | x |")
    assert rows == {"--lora-r": "8", "--lora-dropout": "0.05", "--double-quant": "off"}
    assert not _reads_as(rows["--lora-r"], 16) and _reads_as(rows["--lora-dropout"], 0.05)
    assert not _reads_as(rows["--double-quant"], True) and not _reads_as("auto", 0)


def test_lora_defaults_are_the_recipe_for_every_field() -> None:
    lora = LoraOptions()
    defaults = _train_defaults()
    for f in fields(LoraOptions):
        assert defaults[f"--lora-{f.name.replace('_', '-')}"] == getattr(lora, f.name)
