"""Fine-tune a causal LM with the whole QLoRA memory stack, and report what each piece saved.

With no arguments: a built-in small Llama-architecture model (random weights, nothing
downloaded) learns the Python standard library's source code, byte by byte, with NF4 + double
quantization, LoRA, a planned checkpoint, chunked loss and the paged optimizer.
"""

from __future__ import annotations

import argparse
import os
import time
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

from tightfit.measure.sizes import parse_bytes
from tightfit.optim.registry import OptimizerOptions
from tightfit.qlora.options import LoraOptions, PrepareOptions
from tightfit.train.options import RunConfig, TrainOptions

# (help group title, dataclass, flag prefix, fields renamed on the command line)
_GROUPS: list[tuple[str, type, str, dict[str, str]]] = [
    ("run", TrainOptions, "", {}),
    ("quantization, checkpointing, loss", PrepareOptions, "", {}),
    ("LoRA", LoraOptions, "lora_", {}),
    ("optimizer", OptimizerOptions, "", {"kind": "optimizer"}),
]
_BYTE_FIELDS = {"checkpoint_budget", "page_bytes", "device_budget", "host_budget"}


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
        if int in alts:
            try:
                return parse_bytes(text) if name in _BYTE_FIELDS else int(text)
            except ValueError:
                pass
        if float in alts:
            try:
                return float(text)
            except ValueError:
                pass
        if str in alts or tuple in alts or typing.get_origin(hint) is tuple:
            return text
        allowed = [str(v) for v in literals] + (["none"] if nullable else [])
        kinds = [a.__name__ for a in alts if isinstance(a, type) and a is not type(None)]
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected {' or '.join(allowed + kinds)}")

    only_literals = all(isinstance(a, tuple) or a is type(None) for a in alts)
    choices = [str(v) for v in literals] + (["none"] if nullable else []) if only_literals else None
    return convert, choices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of every piece, generated from the typed option dataclasses."""
    for title, cls, prefix, renames in _GROUPS:
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            dest = prefix + renames.get(f.name, f.name)
            flag = "--" + dest.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            help_text = f.metadata.get("help", "")
            if "default" not in help_text:
                help_text += f" (default: {default})"
            hint = hints[f.name]
            if hint is bool:
                group.add_argument(flag, dest=dest, default=default, help=help_text,
                                   action=argparse.BooleanOptionalAction)
                continue
            convert, choices = _converter(f.name, hint)
            metavar = "{" + ",".join(choices) + "}" if choices else dest.split("_")[-1].upper()
            group.add_argument(flag, dest=dest, default=default, type=convert,
                               metavar=metavar, help=help_text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Build the :class:`RunConfig` (validated by the dataclasses) from parsed arguments."""
    built: dict[str, Any] = {}
    keys = {cls: name for name, cls in typing.get_type_hints(RunConfig).items()}
    for _, cls, prefix, renames in _GROUPS:
        kw = {f.name: getattr(args, prefix + renames.get(f.name, f.name)) for f in fields(cls)}
        built[keys[cls]] = cls(**kw)
    return RunConfig(**built)


def run(args: argparse.Namespace) -> int:
    """``tightfit train``: train, then print the memory report and what was written."""
    from tightfit.train.loop import train

    cfg = config_from_args(args)
    tic = time.perf_counter()
    result = train(cfg)
    elapsed = time.perf_counter() - tic
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun rank 0 prints the (gathered) report
    h = result.history
    print()
    print(result.report.table())
    print()
    if h:
        print(f"loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f} over {len(h)} steps "
              f"(median {result.report.meta['tokens_per_s_median']:.0f} tokens/s); "
              f"{elapsed:.1f} s in all")
    print(f"wrote {result.out}/:")
    for key, path in result.files.items():
        print(f"  {key:13s} {path}")
    return 0
