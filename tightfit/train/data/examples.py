"""Examples: the tokenized data as rows of (token ids, labels), read from the Arrow tables.

:class:`Records` are one example per record (the tokenized table, rows dropped by
truncation left out); :class:`Blocks` cut a plain-text token stream into consecutive
``--seq-len`` blocks, every token trained. Both keep only the row numbers and lengths in RAM;
the tokens stay memory-mapped until a batch reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tightfit.train.data.records import DROPPED, TRUNCATED


class Examples:
    """A set of examples: ``rows`` (which of the source's examples), their ``lengths``."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        self.rows, self.lengths = rows, lengths

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, positions: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """(ids, labels) of the examples at ``positions`` (0..len-1) of this set."""
        return self._fetch([int(self.rows[p]) for p in positions])

    def subset(self, positions: np.ndarray) -> Examples:
        """The examples at ``positions``, as a set of its own."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.rows, new.lengths = self.rows[positions], self.lengths[positions]
        return new

    def targets(self) -> int:
        """Tokens the loss sees (the labels after the shift that are not -100)."""
        raise NotImplementedError

    def max_id(self) -> int:
        """The largest token id in the source (checked against the model's vocabulary)."""
        raise NotImplementedError

    def _fetch(self, rows: list[int]) -> list[tuple[list[int], list[int]]]:
        raise NotImplementedError


class Records(Examples):
    """Tokenized records (:func:`tightfit.train.data.records.tokenize_records`'s table)."""

    def __init__(self, table: Any) -> None:
        self.table = table
        cut = np.asarray(table.data.column("cut"))
        rows = np.nonzero(cut != DROPPED)[0]
        super().__init__(rows, np.asarray(table.data.column("length"))[rows].astype(np.int64))
        self._targets = np.asarray(table.data.column("targets"))
        self.truncated = int((cut[rows] == TRUNCATED).sum())
        self.dropped = int(len(cut) - len(rows))

    def targets(self) -> int:
        return int(self._targets[self.rows].sum())

    def max_id(self) -> int:
        import pyarrow.compute as pc

        flat = [c.flatten() for c in self.table.data.column("input_ids").chunks]
        return max((pc.max(c).as_py() or 0 for c in flat if len(c)), default=0)

    def _fetch(self, rows: list[int]) -> list[tuple[list[int], list[int]]]:
        got = self.table[rows]
        return list(zip(got["input_ids"], got["labels"]))

    def fingerprint(self) -> str:
        return _digest(self.table, ("input_ids", "labels"))


class Blocks(Examples):
    """A token stream (column ``input_ids`` of tokenized lines) in blocks of ``seq_len``."""

    def __init__(self, stream: Any, seq_len: int) -> None:
        import pyarrow as pa

        self.stream, self.seq_len = stream, seq_len
        column = stream.data.column("input_ids")
        # one flat int32 array over the memory-mapped lists: no copy until a block is read
        self.flat = pa.chunked_array([c.flatten() for c in column.chunks], type=pa.int32())
        self.truncated = self.dropped = 0
        n = len(self.flat) // seq_len
        super().__init__(np.arange(n), np.full(n, seq_len, dtype=np.int64))

    def tokens(self) -> int:
        return len(self.flat)

    def targets(self) -> int:
        return len(self) * (self.seq_len - 1)

    def max_id(self) -> int:
        import pyarrow.compute as pc

        return int(pc.max(self.flat).as_py() or 0) if len(self.flat) else 0

    def _fetch(self, rows: list[int]) -> list[tuple[list[int], list[int]]]:
        out = []
        for r in rows:
            ids = self.flat.slice(r * self.seq_len, self.seq_len).to_numpy().tolist()
            out.append((ids, ids))
        return out

    def fingerprint(self) -> str:
        return _digest(self.stream, ("input_ids",))


def _digest(table: Any, columns: tuple[str, ...]) -> str:
    """A hash of the token ids (and example boundaries) of ``columns``, batch by batch."""
    h = hashlib.sha256()
    for batch in table.data.to_batches(max_chunksize=1 << 16):
        for name in columns:
            lists = batch.column(name)
            offsets = np.asarray(lists.offsets)
            h.update((offsets - offsets[0]).astype(np.int64).tobytes())
            h.update(np.asarray(lists.flatten()).tobytes())
    return h.hexdigest()[:16]


def split(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(train, eval): a seeded random ``fraction`` of the examples held out (at least one)."""
    n = len(examples)
    n_eval = max(1, round(fraction * n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    return examples.subset(np.sort(perm[n_eval:])), examples.subset(np.sort(perm[:n_eval]))
