"""Copy engines that count the bytes they copy, and a way to hand one to paged optimizers.

The traffic tests check the store's own counters (``bytes_paged_in``/``_out``) against what the
copy engine was really given to copy: an independent count, so a counter that drifts from the
copies, or a copy that bypasses the engine, fails them. Every byte that changes tier goes
through the store's engine (``PageStore``'s module docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tightfit.optim.base import PagedOptimizer
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore
from tightfit.tiers.copy import CopyEngine, CudaCopyEngine


class Counting:
    """Mixin over a copy engine: the bytes of every copy it makes, by kind.

    Attributes:
        loaded: bytes copied from a page's home into a window slot (the sweep's page-ins).
        stored: bytes copied from a window slot back to a page's home (the sweep's write-backs).
        moved: bytes copied by tier moves between steps (evictions, restores of a re-plan).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loaded = self.stored = self.moved = 0

    def load(self, home: Any, slot: torch.Tensor) -> object:
        handle = super().load(home, slot)  # type: ignore[misc]
        self.loaded += slot.nbytes
        return handle

    def store(self, slot: torch.Tensor, home: Any) -> None:
        super().store(slot, home)  # type: ignore[misc]
        self.stored += slot.nbytes  # the home may be a spill-file page object (no tensor)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        super().copy(dst, src)  # type: ignore[misc]
        self.moved += dst.nbytes

    def counts(self) -> tuple[int, int, int]:
        """``(loaded, stored, moved)`` now."""
        return self.loaded, self.stored, self.moved


class CountingEngine(Counting, CopyEngine):
    """The CPU copy engine, counting."""


class CountingCudaEngine(Counting, CudaCopyEngine):
    """CUDA's copy engine (side stream, events, staging), counting."""


def count_copies(
    monkeypatch: pytest.MonkeyPatch,
    make_engine: Callable[[torch.device], Counting] = lambda device: CountingEngine(),
    **store_kwargs: Any,
) -> list[Counting]:
    """Build the store of every paged optimizer made from now on with ``make_engine(device)``
    (and ``store_kwargs``, e.g. ``emulate_accelerator=True``) through the optimizer's store
    seam, ``PagedOptimizer._new_store``. Returns the engines, in the order they are made."""
    engines: list[Counting] = []

    def new_store(self: PagedOptimizer, device: torch.device, paging: PagingOptions) -> PageStore:
        engine = make_engine(device)
        engines.append(engine)
        return PageStore(device, paging, slabs=self._slabs, engine=engine, **store_kwargs)

    monkeypatch.setattr(PagedOptimizer, "_new_store", new_store)
    return engines


def payload_bytes(pages: list) -> int:
    """Bytes of state arrays in ``pages``, alignment gaps not counted: what a move copies array
    by array (a slab page), where a one-buffer move copies ``page.nbytes``."""
    return sum(numel * dtype.itemsize for page in pages for _, numel, dtype, _ in page.arrays.values())
