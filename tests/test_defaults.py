"""Every public default is defined once: the dataclasses hold it, and the Python API, both
commands' flags and the docs read it from there.

``tightfit train``'s flags are generated from :class:`~tightfit.train.run_options.RunConfig`
(whose groups are the API's own option classes), ``tightfit.prepare`` and
``tightfit.optimizer_for`` take those classes, and ``tightfit plan`` / ``tightfit.plan()``
take their LoRA and dtype defaults from them too. docs/train.md's option table states each
default; a change to a default that forgets the docs fails here.
"""

from __future__ import annotations

import argparse
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
UNSET = {"none", "auto", "all", "built-in", "stdlib source", "pager's", "temp folder",
         "the model folder's", ""}


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


def _plan_defaults() -> dict[str, object]:
    parser = build_parser("plan")
    sub = next(a for a in parser._actions if a.dest == "command").choices["plan"]
    return {a.option_strings[0]: a.default for a in sub._actions if a.option_strings
            and a.option_strings[0].startswith("--") and a.default is not argparse.SUPPRESS}


# What plan and train ask about differs here on purpose: plan sizes a real model's step
# (2048 tokens x 1, bf16 on a GPU), the built-in demo's is 128 x 8; train's "auto" compute
# dtype is bf16 on CUDA, as plan assumes.
PLAN_ONLY = {"--seq-len": (2048, 128), "--batch-size": (1, 8),
             "--compute-dtype": ("bfloat16", "auto")}


def test_plan_flags_default_to_plan_and_share_train_defaults() -> None:
    import tightfit

    signature = {f"--{k.replace('_', '-')}": p.default
                 for k, p in inspect.signature(tightfit.plan).parameters.items()}
    flags = _plan_defaults()
    differ = {f: (v, signature[f]) for f, v in flags.items()
              if f in signature and f not in ("--margin", "--model") and v != signature[f]}
    assert differ == {}, "tightfit plan's flags vs tightfit.plan()'s defaults"
    train = _train_defaults()
    shared = sorted(set(flags) & set(train))
    assert {"--lora-r", "--lora-dropout", "--lora-dtype", "--lora-target-modules"} <= set(shared)
    for f in shared:
        want = PLAN_ONLY.get(f, (train[f], train[f]))
        assert (flags[f], train[f]) == want, f


def test_docs_state_plan_defaults() -> None:
    # docs/plan.md names each option with its default in brackets: `--lora-r` (16)
    text = (DOCS / "plan.md").read_text()
    flags = _plan_defaults()
    said = {f: v for f, v in re.findall(r"`(--[\w-]+)` \(([^)`]+)\)", text)}
    checked = {f: v for f, v in said.items()
               if f in flags and flags[f] is not None and not isinstance(flags[f], bool)}
    assert {"--lora-r", "--lora-dropout", "--batch-size", "--slack"} <= set(checked)
    for flag, doc in checked.items():
        # "(16)", "(float32; bfloat16 as ...)", "(all-linear: every projection ...)",
        # "(CUDA context, workspaces: 1 GiB)": the value before or after the explanation
        clause = doc.split(";")[0]
        values = {clause.partition(":")[0], clause.rpartition(":")[2]}
        assert any(_reads_as(v.replace(" ", ""), flags[flag]) for v in values), \
            (flag, doc, flags[flag])
