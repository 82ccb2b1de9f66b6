"""Examples → the micro-batches of each step, a pure function of ``(seed, step)``.

Each epoch is a seeded permutation of the examples; a step takes ``batch_size × grad_accum``
rows of it, as ``grad_accum`` micro-batches of ``batch_size`` rows:

* ``bucket`` (as transformers' ``LengthGroupedSampler``): the permutation in megabatches of
  16 steps, each sorted by length and cut into steps, the steps shuffled; every example keeps
  its own length and a micro-batch is padded to its longest (``attention_mask`` 0, labels -100);
* ``pack`` (as transformers' ``DataCollatorWithFlattening``, in rows): examples first-fit into
  ``--seq-len`` rows; ``position_ids`` restart at 0 for each example and there is no
  ``attention_mask``, so transformers' masking builds attention that does not cross examples;
  each example's first label is -100, so no token is trained to predict the next example.

A run resumed at step k sees exactly the batches the uninterrupted run saw, with no sampler
state to save. Each micro-batch's figures (real tokens, padded slots, trained targets) feed
the padding / packing efficiency.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from tightfit.train.data.examples import Examples
from tightfit.train.data.records import IGNORE

_MEGABATCH_STEPS = 16
Plan = list[list[list[list[int]]]]  # steps → micro-batches → rows → example positions


class Batcher:
    """The step batches of one run over a set of examples."""

    def __init__(self, examples: Examples, *, batch_size: int, grad_accum: int, seq_len: int,
                 mode: str, seed: int, pad_id: int) -> None:
        self.examples, self.mode, self.seed = examples, mode, seed
        self.batch_size, self.grad_accum, self.seq_len = batch_size, grad_accum, seq_len
        self.pad_id = pad_id
        self._plans: dict[int, Plan] = {}
        self._starts = [0]  # first step of each epoch planned so far

    def step(self, step: int) -> list[MicroBatch]:
        """The ``grad_accum`` micro-batches of training step ``step`` (0-based)."""
        while self._starts[-1] <= step:  # plan epochs until one holds the step
            self._starts.append(self._starts[-1] + len(self._plan(len(self._starts) - 1)))
        epoch = bisect.bisect_right(self._starts, step) - 1
        return [self.collate(rows) for rows in self._plan(epoch)[step - self._starts[epoch]]]

    def steps_per_epoch(self) -> int:
        """Steps of the first epoch (each epoch's count is close: packing varies a little)."""
        return len(self._plan(0))

    def collate(self, rows: list[list[int]], *, length: int | None = None,
                mode: str | None = None) -> MicroBatch:
        """One micro-batch: each row one example (bucket) or several packed ones (pack)."""
        packed = (mode or self.mode) == "pack"
        flat = self.examples.get([p for row in rows for p in row])
        it = iter(flat)
        per_row = [[next(it) for _ in row] for row in rows]
        width = length or max(1, *(sum(len(x) for x, _ in row) for row in per_row))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.int64)
        extra = torch.zeros((len(rows), width), dtype=torch.int64)  # positions or mask
        for r, row in enumerate(per_row):
            at = 0
            for x, y in row:
                n = len(x)
                ids[r, at : at + n] = torch.tensor(x)
                labels[r, at : at + n] = torch.tensor(y)
                if packed:
                    labels[r, at] = IGNORE  # never predict one example from the one before
                    extra[r, at : at + n] = torch.arange(n)
                else:
                    extra[r, at : at + n] = 1
                at += n
            if packed:  # the padding: a segment of its own, so it never joins an example
                extra[r, at:] = torch.arange(width - at)
        inputs = {"input_ids": ids, "labels": labels,
                  ("position_ids" if packed else "attention_mask"): extra}
        return MicroBatch(inputs, tokens=sum(len(x) for x, _ in flat), slots=ids.numel())

    def largest(self) -> dict[str, torch.Tensor]:
        """A micro-batch of the largest shape the run will see (the planner profiles it)."""
        if self.mode == "pack":
            return self.collate(self._plan(0)[0][0], length=self.seq_len).inputs
        longest = np.argsort(-self.examples.lengths, kind="stable")[: self.batch_size]
        return self.collate([[int(p)] for p in longest]).inputs

    def _plan(self, epoch: int) -> Plan:
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = self._build(epoch)  # two epochs at most in RAM
        return self._plans[epoch]

    def _build(self, epoch: int) -> Plan:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.examples), generator=g).numpy()
        steps = self._pack(perm) if self.mode == "pack" else self._buckets(perm, g)
        b = self.batch_size
        return [[rows[m * b : (m + 1) * b] for m in range(self.grad_accum)] for rows in steps]

    def _buckets(self, perm: np.ndarray, g: torch.Generator) -> list[list[list[int]]]:
        group = self.batch_size * self.grad_accum
        mega = group * _MEGABATCH_STEPS
        steps = []
        for lo in range(0, len(perm), mega):
            chunk = perm[lo : lo + mega]
            chunk = chunk[np.argsort(-self.examples.lengths[chunk], kind="stable")]
            steps += [[[int(p)] for p in chunk[k : k + group]]
                      for k in range(0, len(chunk) - group + 1, group)]
        order = torch.randperm(len(steps), generator=g).tolist()
        return [steps[i] for i in order]

    def _pack(self, perm: np.ndarray) -> list[list[list[int]]]:
        n_rows, lengths = self.batch_size * self.grad_accum, self.examples.lengths
        steps: list[list[list[int]]] = []
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        free = [self.seq_len] * n_rows
        for p in perm.tolist():
            need = int(lengths[p])
            r = next((r for r in range(n_rows) if free[r] >= need), None)
            if r is None:  # no row of this step has room: the step is full
                steps.append(rows)
                rows, free, r = [[] for _ in range(n_rows)], [self.seq_len] * n_rows, 0
            rows[r].append(p)
            free[r] -= need
        if any(rows):
            steps.append(rows)
        return steps

    def eval_batches(self, row_multiple: int = 1) -> Iterator[MicroBatch]:
        """The whole set in padded micro-batches by length (rows a multiple of ``row_multiple``:
        filler rows repeat an example with every label -100)."""
        order = np.argsort(-self.examples.lengths, kind="stable").tolist()
        for lo in range(0, len(order), self.batch_size):
            rows = [[p] for p in order[lo : lo + self.batch_size]]
            fill = -len(rows) % row_multiple
            batch = self.collate(rows + [rows[0]] * fill, mode="bucket")
            if fill:
                batch.inputs["labels"][len(rows):] = IGNORE
            yield batch


@dataclass
class MicroBatch:
    """One forward pass's inputs (global rows under torchrun) and its figures."""

    inputs: dict[str, torch.Tensor]
    tokens: int  # the examples' tokens (no padding)
    slots: int  # rows x width: what the forward pass computes

    @property
    def targets(self) -> int:
        """Labels the loss sees: after the shift, not -100."""
        return int((self.inputs["labels"][:, 1:] != IGNORE).sum())
