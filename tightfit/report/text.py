"""Text that fits :data:`WIDTH` (100) columns: wrapped lines, tables that wrap a text column,
and the log formatter the command line prints its messages with.

A line longer than the width wraps at spaces onto continuation lines indented two columns
past its own indent; a word longer than a line (a path) is kept whole. A table too wide for
the width wraps its widest text columns inside their cells, the other cells of a
continuation line left blank.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence

__all__ = ["WIDTH", "WrappingFormatter", "pack", "text_table", "wrap"]

#: The widest line ``tightfit train`` prints (the report's full detail is in report.json).
WIDTH = 100


def wrap(text: str, width: int = WIDTH, indent: int = 2) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces.

    Args:
        text: One or more lines.
        width: The widest line wanted.
        indent: Continuation lines start this many columns past the wrapped line's indent.
    """
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(line.strip(), width, initial_indent=lead,
                             subsequent_indent=lead + " " * indent, break_long_words=False,
                             break_on_hyphens=False) or [line]
    return "\n".join(out)


def pack(parts: Sequence[str], prefix: str = "", sep: str = "; ", width: int = WIDTH,
         indent: int = 2) -> list[str]:
    """``prefix`` and ``parts`` joined by ``sep`` into as few lines of ``width`` as they go:
    a line breaks between parts (after the separator), onto a line indented ``indent``; a part
    too long for a line alone wraps (:func:`wrap`)."""
    lines: list[str] = []
    cur, fresh = prefix, True
    for part in parts:
        joined = cur + part if fresh else cur + sep + part
        if fresh or len(joined) <= width:
            cur, fresh = joined, False
        else:
            lines.append(cur + sep.rstrip())
            cur = " " * indent + part
    lines.append(cur)
    return [line for text in lines for line in wrap(text, width, indent).split("\n")]


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]], *, width: int = WIDTH,
               wrap_columns: Sequence[int] = (), right: Sequence[int] = ()) -> list[str]:
    """A plain-text table (header, dashes, rows) no wider than ``width`` where it can be.

    Args:
        head: The column names.
        rows: One list of cells per row.
        width: The widest line wanted.
        wrap_columns: Columns whose cells may wrap onto more lines (the widest shrinks first,
            down to its longest word).
        right: Columns aligned right (numbers).
    """
    table = [list(head), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    floor = {i: max(len(w) for r in table for w in (r[i].split() or [""])) for i in wrap_columns}
    floor.update({i: max(floor[i], len(head[i])) for i in wrap_columns})
    while sum(widths) + 2 * (len(widths) - 1) > width:
        shrinkable = [i for i in wrap_columns if widths[i] > floor[i]]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    lines = [line for r in table for line in _row_lines(r, widths, set(right))]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _row_lines(row: list[str], widths: list[int], right: set[int]) -> list[str]:
    cells = [textwrap.wrap(c, w, break_long_words=False, break_on_hyphens=False) or [""]
             for c, w in zip(row, widths)]
    out = []
    for k in range(max(len(c) for c in cells)):
        parts = [(c[k] if k < len(c) else "") for c in cells]
        out.append("  ".join(p.rjust(w) if i in right else p.ljust(w)
                             for i, (p, w) in enumerate(zip(parts, widths))).rstrip())
    return out


class WrappingFormatter(logging.Formatter):
    """Formats a record as its message alone, each line wrapped at :data:`WIDTH` columns."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return wrap(super().format(record))
