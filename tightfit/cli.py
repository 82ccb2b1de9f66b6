"""The ``tightfit`` command line: one subcommand per job.

Each subcommand lives in the package that owns it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them up, so
the options a user sees come from the same typed signatures the Python API uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (name, module, one-line help). A module is imported only when its command runs.
_COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "tightfit.optim.demo", "short paged-optimizer demonstration (prints what was paged)"),
    ("train", "tightfit.train.cli", "fine-tune with the whole QLoRA memory stack; measured report"),
    ("plan", "tightfit.planner.cli", "will this fine-tune fit? predicted bytes per piece, a recommended setup"),
    ("export", "tightfit.train.export", "a run's adapter and, with --merge, a merged HF model folder"),
]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the argument parser.

    Args:
        command: The subcommand about to run. Only its module is imported (the others
            pull in transformers, peft, ... and cost seconds); ``None`` imports all of
            them, which ``--help`` of every command and the docs need.
    """
    parser = argparse.ArgumentParser(
        prog="tightfit",
        description="Fine-tune large language models in far less memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in _COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, help=help_text)  # listed in --help, not imported
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _chosen_command(argv: Sequence[str]) -> str | None:
    names = {name for name, _, _ in _COMMANDS}
    for arg in argv:
        if arg in names:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tightfit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen_command(argv)
    parser = build_parser(chosen if chosen is not None else "")
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        # Bad input: say what is wrong and how to fix it, without a traceback.
        print(f"tightfit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
