"""Fine-tune a causal LM with the whole QLoRA memory stack, and report what each piece saved.

With no arguments: a built-in small Llama-architecture model (random weights, nothing
downloaded) learns the Python standard library's source code, byte by byte, with NF4 + double
quantization, LoRA, a planned checkpoint, chunked loss and the paged optimizer. With --model
DIR --data FILE: a real fine-tune on plain text, or on text, prompt/completion, Alpaca
(instruction/input/output) or chat records (JSON/JSONL/Parquet/CSV). Defaults are the QLoRA
recipe (lr 2e-4, constant schedule after warmup, LoRA r=16 alpha=16, gradient norm clipped at
0.3) with LoRA dropout 0 (less memory per adapted input); the built-in demo uses them too. --resume DIR continues a run with its saved options.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
import types
import typing
from dataclasses import fields
from typing import Any, Literal

from tightfit.measure.dtypes import SHORT_NAMES
from tightfit.measure.sizes import parse_bytes
from tightfit.train.run_options import RunConfig, cli_fields, flag_dest, flag_name
from tightfit.train.validate import check_run

_TITLES = {"train": "run", "data": "data", "prepare": "quantization, checkpointing, loss",
           "lora": "LoRA", "optimizer": "optimizer"}
_BYTE_FIELDS = {"checkpoint_budget", "page_bytes", "device_budget", "host_budget", "target",
                "max_text_bytes"}
# What argparse takes for a value rather than a flag when it starts with "-": its own rule
# knows only plain negative numbers, so "--device-budget -1GiB" or "--lr -1e-3" would say
# "expected one argument" instead of what is wrong with the value.
_NEGATIVE_VALUE = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\s*[A-Za-z]*$")


def _alternatives(hint: Any) -> list[Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in _alternatives(arg)]
    if origin is Literal:
        return [("literal", v) for v in typing.get_args(hint)]
    return [hint]


def _converter(name: str, hint: Any) -> tuple[Any, list[str] | None]:
    """An argparse ``type`` for a dataclass field, and its choices when it has a few."""
    alts = _alternatives(hint)
    literals = [a[1] for a in alts if isinstance(a, tuple)]
    nullable = type(None) in alts

    def convert(text: str) -> Any:
        if nullable and text.lower() == "none":
            return None
        for lit in literals:
            if text == str(lit):
                return lit
        if SHORT_NAMES.get(text) in literals:
            return SHORT_NAMES[text]  # "bf16" for a dtype option: the one dtype table's name
        if float in alts and "." in text and text.replace(".", "", 1).isdigit():
            return float(text)  # "1.0" is a fraction (--target), not one byte
        size_error = None
        if int in alts:
            try:
                return parse_bytes(text) if name in _BYTE_FIELDS else int(text)
            except ValueError as exc:
                size_error = exc if name in _BYTE_FIELDS else None
        if float in alts:
            try:
                value = float(text)
            except ValueError:
                pass
            else:
                if not math.isfinite(value):  # inf/nan would train on, then fail at a step
                    raise argparse.ArgumentTypeError(
                        f"invalid value {text!r}; expected a finite number"
                        + (" (or none)" if nullable else ""))
                return value
        if size_error is not None:  # say what is wrong with the size, not "expected int"
            reason = str(size_error).partition(": ")[2] or str(size_error)
            raise argparse.ArgumentTypeError(reason.rstrip(".") + ("; or none." if nullable else "."))
        if str in alts or tuple in alts or typing.get_origin(hint) is tuple:
            return text
        allowed = [str(v) for v in literals] + (["none"] if nullable else [])
        kinds = [a.__name__ for a in alts if isinstance(a, type) and a is not type(None)]
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected {' or '.join(allowed + kinds)}")

    only_literals = all(isinstance(a, tuple) or a is type(None) for a in alts)
    choices = [str(v) for v in literals] + (["none"] if nullable else []) if only_literals else None
    return convert, choices


def _option_keys() -> list[tuple[str, type, Any]]:
    """``("group.option", the option's dataclass, its default)`` for every option of a run."""
    defaults = RunConfig()
    out = []
    for group in fields(RunConfig):
        options = getattr(defaults, group.name)
        out += [(f"{group.name}.{f.name}", type(options), getattr(options, f.name))
                for f in cli_fields(type(options))]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of every piece, generated from the typed option dataclasses.

    A flag's default is the :class:`RunConfig` default (the QLoRA recipe), shown in its help;
    flags that are not given stay out of the parsed namespace, so that ``--resume`` can tell
    what was given again.
    """
    parser._negative_number_matcher = _NEGATIVE_VALUE  # (no flag of ours looks like "-1")
    # argparse prints the usage above each error: the generated one lists all ~60 flags,
    # 30 lines that bury the one-line error under them (--help still lists every flag).
    parser.usage = "%(prog)s [options]   (%(prog)s --help lists them)"
    groups: dict[str, Any] = {}
    for key, cls, default in _option_keys():
        group_name, _, name = key.partition(".")
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(_TITLES[group_name])
        f = next(f for f in fields(cls) if f.name == name)
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:
            help_text += f" (default: {shown})"
        hint = typing.get_type_hints(cls)[name]
        kw: dict[str, Any] = {"dest": flag_dest(key), "default": argparse.SUPPRESS,
                              "help": help_text}
        if hint is bool:
            groups[group_name].add_argument(flag_name(key), action=argparse.BooleanOptionalAction,
                                            **kw)
            continue
        convert, choices = _converter(name, hint)
        metavar = "{" + ",".join(choices) + "}" if choices else flag_dest(key).split("_")[-1].upper()
        groups[group_name].add_argument(flag_name(key), type=convert, metavar=metavar, **kw)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """``{"group.option": value}`` of the flags given on the command line."""
    return {key: getattr(args, flag_dest(key)) for key, _, _ in _option_keys()
            if hasattr(args, flag_dest(key))}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of parsed arguments (validated by the dataclasses).

    A fresh run: the defaults with the given flags. ``--resume DIR``: the configuration saved
    in DIR, with the few options a resume may change (:func:`tightfit.train.resume.resumed_config`).
    """
    given = given_options(args)
    if "train.steps" in given and given.get("train.epochs") is not None:
        raise ValueError("--steps and --epochs both say how long to train; pass one of them.")
    if given.get("train.resume") is not None:
        from tightfit.train.resume import resumed_config

        return resumed_config(given["train.resume"], given)
    return RunConfig().with_flat(given)


def run(args: argparse.Namespace) -> int:
    """``tightfit train``: train, then print the memory report and what was written."""
    cfg = config_from_args(args)
    # what the options, the machine and the files can refuse, before the seconds that the
    # loop's imports (transformers, peft, bitsandbytes, datasets) take
    check_run(cfg)
    from tightfit.train.loop import train

    quiet = bool(getattr(args, "quiet", False))
    tic = time.perf_counter()
    result = train(cfg, progress=not quiet)
    elapsed = time.perf_counter() - tic
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun rank 0 prints the (gathered) report
    if not quiet:
        _print_summary(result, elapsed)
    print(f"wrote {result.out}/:")
    for key, path in result.files.items():
        print(f"  {key:13s} {path}")
    return 0


def _print_summary(result: Any, elapsed: float) -> None:
    """The report table, the loss, the tokens trained and the eval loss (stdout)."""
    from tightfit.report.text import wrap  # ≤ 100 columns, as the report

    h = result.history
    print()
    print(result.report.table())
    print()
    if h:
        print(f"loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f} over {len(h)} steps "
              f"(median {result.report.meta['tokens_per_s_median']:.0f} tokens/s); "
              f"{elapsed:.1f} s in all")
    meta = result.report.meta
    eff = meta["batch_efficiency"]
    if eff["efficiency"] is not None:
        kind = "packing" if eff["batching"] == "pack" else "padding"
        print(wrap(f"trained on {meta['trained_tokens']:,} target tokens; {kind} efficiency "
                   f"{eff['efficiency']:.1%} (the examples' share of the tokens computed)"))
    evals = [x for x in h if x.get("eval_loss") is not None]
    if evals:
        print(f"eval loss {evals[-1]['eval_loss']:.3f} (perplexity "
              f"{evals[-1]['eval_perplexity']:.2f}) at step {evals[-1]['step']}")
