"""The ``tightfit`` command line: one subcommand per job.

Each subcommand lives in the package that owns it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them up, so
the options a user sees come from the same typed signatures the Python API uses.

Output: results (the report, the plan) go to stdout; messages go through :mod:`logging`
(the ``tightfit`` logger: INFO and DEBUG on stdout, warnings and errors on stderr), ``-v``
adds DEBUG, ``--quiet`` keeps warnings and errors only. Exit codes: 0 done, 1 a step ran out
of memory twice (train: the last completed step saved) or nothing fits (plan), 2 bad input
(nothing changed), 130 Ctrl-C and 143 SIGTERM (train: the last completed step saved; every
command removes its temporary files first).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from tightfit.integrity.interrupts import interrupt_signal, terminate_as_interrupt

# (name, module, one-line help). A module is imported only when its command runs.
_COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "tightfit.optim.demo", "short paged-optimizer demonstration (prints what was paged)"),
    ("train", "tightfit.train.train_command", "fine-tune with the whole QLoRA memory stack; measured report"),
    ("plan", "tightfit.planner.plan_command", "will this fine-tune fit? predicted bytes per piece, a recommended setup"),
    ("export", "tightfit.train.export", "a run's adapter and, with --merge, a merged HF model folder"),
]

logger = logging.getLogger("tightfit")


def version() -> str:
    """The installed package's version (``tightfit.__version__`` when installed as built)."""
    try:
        return metadata.version("tightfit")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _verbosity(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Given before or after the command; a subcommand's flags must not reset the top ones.
    default = 0 if top else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more messages (-v: each step's loss and time, paging decisions)")
    parser.add_argument("-q", "--quiet", action="store_true", default=default or False,
                        help="warnings and errors only: no progress bar, no notes")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the argument parser.

    Args:
        command: The subcommand about to run. Only its module is imported (the others
            pull in transformers, peft, ... and cost seconds); ``None`` imports all of
            them, which ``--help`` of every command and the docs need.
    """
    # no abbreviations: "--batch 2" would silently be --batch-size, an old name passing as new
    parser = argparse.ArgumentParser(
        prog="tightfit",
        description="Fine-tune large language models in far less memory.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"tightfit {version()}")
    _verbosity(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in _COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, help=help_text)  # listed in --help, not imported
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           allow_abbrev=False)
        _verbosity(p, top=False)
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


class _Below(logging.Filter):
    """Passes records below a level (INFO and DEBUG to stdout; the rest go to stderr)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _CurrentStream(logging.StreamHandler):
    """Writes to ``sys.stdout``/``sys.stderr`` as they are at each message (a redirect or a
    test's capture replaces them after the handler was made)."""

    def __init__(self, which: str) -> None:
        self._which = which
        super().__init__()

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return getattr(sys, self._which)

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys stream


def configure_logging(verbose: int = 0, quiet: bool = False) -> None:
    """Route the ``tightfit`` logger to stdout (INFO, DEBUG) and stderr (warnings, errors).

    Args:
        verbose: ``-v`` given (count): DEBUG messages too.
        quiet: ``--quiet``: warnings and errors only.
    """
    for h in list(logger.handlers):
        logger.removeHandler(h)
    out, err = _CurrentStream("stdout"), _CurrentStream("stderr")
    out.addFilter(_Below(logging.WARNING))
    err.setLevel(logging.WARNING)
    from tightfit.report.text import WrappingFormatter  # light: no torch

    for h in (out, err):
        h.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(h)
    out.setFormatter(WrappingFormatter())  # notes wrap at 100 columns; an error stays one line
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Hide what other libraries say on every command that is not the user's business.

    bitsandbytes logs a warning on import on CPUs with AVX512-BF16 when the optional
    ``kernels`` package (a Hugging Face hub download of a faster CPU 4-bit matmul) is not
    installed; it then uses its own kernel, which is what tightfit measures with.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessage("kernels-community"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tightfit`` console script (and ``python -m tightfit``)."""
    quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen_command(argv)
    parser = build_parser(chosen if chosen is not None else "")
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.quiet)
    try:
        with terminate_as_interrupt():  # SIGTERM takes Ctrl-C's path: save, clean up, say so
            return int(args._run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        # Bad input: say what is wrong and how to fix it, without a traceback.
        logger.error("tightfit %s: error: %s", args.command, exc)
        return 2
    except KeyboardInterrupt as exc:
        logger.error("tightfit %s: %s", args.command, str(exc) or "interrupted")
        return 128 + interrupt_signal(exc)  # 130 for Ctrl-C, 143 for SIGTERM
    except RuntimeError as exc:
        from tightfit.train.loop import RankStopped  # only once a run has failed
        from tightfit.train.step import StepOutOfMemory

        if isinstance(exc, RankStopped):  # the failed rank's own line says it all
            logger.debug("tightfit %s: %s", args.command, exc)
            return 1
        if not isinstance(exc, StepOutOfMemory):
            raise
        logger.error("tightfit %s: %s", args.command, exc)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
