"""Will this run's step fit its real limit? One configuration, not the ladder.

``tightfit plan`` compares a ladder of configurations on a device it is told about.
``tightfit train`` asks a narrower question before it reads any data: does *its own*
configuration (its options, with ``auto`` left for the planner to size) fit the memory it
will really run in, and if not, what is the longest sequence that does? :func:`run_fit`
answers it with the same memory model and the same sizing rules as the ladder's rows
(:func:`tightfit.planner.ladder.sized`): the checkpoint budget and a paged optimizer's
resident state get the room left, the loss chunk and the MLP tile follow the long-context
row's rules, and with ``paged_weights`` as many layers' 4-bit weights stay on the device as
fit (:func:`tightfit.planner.paged_weights.fit_resident_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tightfit.measure.sizes import format_bytes
from tightfit.planner.estimate import Overhead, untiled_mlp
from tightfit.planner.host import HostLimit
from tightfit.planner.ladder import Rung, Sizing, evaluate, sized
from tightfit.planner.max_length import maximize_row
from tightfit.planner.presets import load_shape
from tightfit.planner.shapes import ModelShape
from tightfit.planner.table import Row
from tightfit.planner.train_setup import TrainSetup


@dataclass(frozen=True)
class RunFit:
    """What :func:`run_fit` found.

    Attributes:
        row: The run's configuration at its own sequence length, sized as planned.
        longest: The same configuration at the longest sequence that fits (``maximum``:
            that length, 0 when nothing fits; ``limit``: what stops it).
        limit_bytes: The memory the step was checked against.
        limit_source: Where that figure came from (for messages).
    """

    row: Row
    longest: Row
    limit_bytes: int
    limit_source: str

    @property
    def fits(self) -> bool:
        """The run's step fits the device and the host (no margin: a refusal is certain)."""
        return self.row.fits

    def describe(self) -> str:
        """One line: the step's predicted bytes against the limit, and the longest."""
        est = self.row.estimate
        total = "n/a" if est is None else format_bytes(est.total)
        longest = self.longest.maximum or 0
        return (f"{self.row.setup.seq_len:,} tokens per sequence predicted at {total} of the "
                f"{format_bytes(self.limit_bytes)} of {self.limit_source}; the longest that "
                f"fits these options: {longest:,} tokens ({self.longest.limit} binds)")


def run_fit(model: str | Path | ModelShape | dict[str, Any], setup: TrainSetup, *,
            limit_bytes: int, limit_source: str, overhead_bytes: int, host: HostLimit,
            chunked: bool, tiled: bool, paged_weights: bool, slack: float = 0.05) -> RunFit:
    """Predict whether ``setup`` fits ``limit_bytes``, and the longest sequence that does.

    Args:
        model: A preset, a ``config.json`` (or its folder), a config dict or a shape.
        setup: The run's configuration; with ``checkpoint="budget"`` its budget is sized to
            the room left, as the ladder's rows are (the value given is ignored).
        limit_bytes: The memory the step runs in (a GPU's, a memory cgroup's limit, RAM).
        limit_source: What ``limit_bytes`` is, for :meth:`RunFit.describe`.
        overhead_bytes: Memory that is not the step's tensors (a CUDA context; on the CPU the
            process itself before the model is loaded).
        host: The next tier's limit (pinned host RAM on CUDA; the spill folder's free disk
            on the CPU).
        chunked: The loss chunk is the planner's (``--loss-chunks auto``).
        tiled: The MLP tile is the planner's (``--mlp-tile auto``); a family whose MLP does
            not tile is planned untiled.
        paged_weights: The resident layers are the planner's (as many as fit).
        slack: Allocator slack, a fraction of the tensor bytes.

    Returns:
        A :class:`RunFit`.
    """
    shape = load_shape(model)
    sizing = Sizing(shape, int(limit_bytes), Overhead(fixed_bytes=int(overhead_bytes),
                                                      fraction=slack), host)
    rung = Rung("this run", setup, chunked=chunked,
                tiled=tiled and untiled_mlp(shape) is None, paged_weights=paged_weights)
    row = evaluate(rung, sizing, sized(rung, sizing, setup.seq_len, setup.batch_size))

    def row_at(n: int) -> Row:
        return evaluate(rung, sizing, sized(rung, sizing, n, setup.batch_size, monotone=True))

    longest = maximize_row(row_at, cap=shape.max_positions, granularity=1, what="seq")
    return RunFit(row, longest, int(limit_bytes), limit_source)
