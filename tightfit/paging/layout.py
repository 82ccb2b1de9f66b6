"""Where each element of optimizer state lives: state specs, segments and pages.

A param group's state is cut by (group, param dtype) into *pages*: one byte buffer per page,
holding every state array (``exp_avg``, ``exp_avg_sq`` … or 8-bit codes and their absmax) for
one contiguous range of elements. Keeping all arrays of an element range in one buffer means a
page moves between tiers in one copy, and a blockwise-quantized layout keeps its scales next to
its codes. Params are laid out back to back; a large param is split across pages, small params
share a page. This module is pure bookkeeping: no tensor is allocated here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_ALIGN = 64  # byte alignment of each state array inside a page (cache line, vector loads)


@dataclass(frozen=True)
class StateSpec:
    """One per-element state array of an optimizer.

    Args:
        name: state name as in torch's state dict (``"exp_avg"``) or a layout-private name.
        dtype: storage dtype of the array.
        block: one stored value per ``block`` elements (1 for plain state; 256 for the fp32
            absmax of a 256-element quantization block).
    """

    name: str
    dtype: torch.dtype
    block: int = 1

    def numel(self, elements: int) -> int:
        """Stored values needed for ``elements`` state elements."""
        return math.ceil(elements / self.block)


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one param's elements stored in one page.

    Attributes:
        param: index of the param within its group's ``params`` list.
        start: first element of the run in the flattened param.
        length: number of elements.
        offset: element offset of the run inside the page (a multiple of the layout unit).
    """

    param: int
    start: int
    length: int
    offset: int


@dataclass
class Page:
    """One page: metadata plus, when it is in memory, its byte buffer.

    Tier and buffer are owned by :class:`~tightfit.paging.store.PageStore`; the optimizer only
    reads ``segments`` and asks the store for views.
    """

    index: int  # position in the store's page list (also the sweep order)
    group: int
    dtype: torch.dtype  # dtype of the params whose state this page holds
    elements: int  # element span, padding included
    nbytes: int
    # name -> (byte offset, numel, dtype, block)
    arrays: dict[str, tuple[int, int, torch.dtype, int]]
    segments: list[Segment] = field(default_factory=list)
    # residency, managed by the store
    tier: str = "device"
    buf: torch.Tensor | None = None
    spill_offset: int = -1
    updated_step: int = -1  # step id of the last sweep that updated this page
    spill_valid: bool = False  # the spill file holds this page's current bytes (no write-back)
    # the disk tier's integrity (tightfit.paging.disk): blocks reserved for the page's range,
    # the checksum of the bytes last written there, and why they are lost (a failed write)
    spill_reserved: bool = False
    spill_checksum: int | None = None
    spill_lost: str | None = None
    # the store's views of a device/host-tier page's arrays, and the segment views on them
    _arrays: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _views: tuple | None = field(default=None, repr=False, compare=False)

    def owns(self, arrays: dict[str, torch.Tensor]) -> bool:
        """Whether ``arrays`` are the store's own views of this page's memory in the device or
        host tier (:meth:`~tightfit.paging.store.PageStore.arrays`): the same objects until the
        page moves, so they can key a cache. A window slot's views or a copy's are not."""
        return arrays is self._arrays

    def copy_state(
        self,
        dst: torch.Tensor | dict[str, torch.Tensor],
        src: torch.Tensor | dict[str, torch.Tensor],
        copy: Callable[[torch.Tensor, torch.Tensor], object] = torch.Tensor.copy_,
    ) -> None:
        """Copy this page's state from ``src`` to ``dst``, each its bytes in the one-buffer
        format or its typed arrays (a slab's views): one copy when both are buffers, else one
        per array. ``copy(dst, src)`` does each copy (a tier move passes its engine's)."""
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
            copy(dst, src)
            return
        dst_arrays = self.array_views(dst) if isinstance(dst, torch.Tensor) else dst
        src_arrays = self.array_views(src) if isinstance(src, torch.Tensor) else src
        for name, view in dst_arrays.items():
            copy(view, src_arrays[name])

    def array_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed flat views of each state array inside ``buf`` (this page's bytes)."""
        out = {}
        for name, (off, numel, dtype, _block) in self.arrays.items():
            size = numel * dtype.itemsize
            out[name] = buf[off : off + size].view(dtype)
        return out

    def segment_views(
        self, data: torch.Tensor | dict[str, torch.Tensor]
    ) -> dict[str, list[torch.Tensor]]:
        """Per state array, one view per segment (in segment order).

        Args:
            data: the page's bytes in the one-buffer format, or its typed arrays (as
                :meth:`~tightfit.paging.store.PageStore.arrays` gives them).

        The views of the store's own arrays of a resident page are cached (made once, not every
        step); views of anything else (window slots, CPU copies) are made afresh.
        """
        if data is self._arrays:
            cached = self._views
            if cached is not None and cached[0] is data:
                return cached[1]
            views = self._make_segment_views(data)
            self._views = (data, views)
            return views
        return self._make_segment_views(data)

    def _make_segment_views(
        self, data: torch.Tensor | dict[str, torch.Tensor]
    ) -> dict[str, list[torch.Tensor]]:
        arrays = self.array_views(data) if isinstance(data, torch.Tensor) else data
        out: dict[str, list[torch.Tensor]] = {}
        for name, flat in arrays.items():
            block = self.arrays[name][3]
            out[name] = [
                flat[s.offset // block : s.offset // block + math.ceil(s.length / block)]
                for s in self.segments
            ]
        return out


def _page_nbytes(specs: list[StateSpec], elements: int) -> tuple[int, dict]:
    arrays = {}
    off = 0
    for spec in specs:
        numel = spec.numel(elements)
        arrays[spec.name] = (off, numel, spec.dtype, spec.block)
        size = numel * spec.dtype.itemsize
        off += -(-size // _ALIGN) * _ALIGN
    return off, arrays


def page_capacity(specs: list[StateSpec], unit: int, page_bytes: int) -> int:
    """Largest element count (a multiple of ``unit``) whose state fits in ``page_bytes``."""
    per_elem = sum(s.dtype.itemsize / s.block for s in specs)
    cap = int(page_bytes // per_elem) // unit * unit
    while cap > 0 and _page_nbytes(specs, cap)[0] > page_bytes:
        cap -= unit
    return cap


def build_pages(
    group: int,
    numels: list[int],
    dtypes: list[torch.dtype],
    specs: list[StateSpec],
    unit: int,
    page_bytes: int,
    first_index: int,
) -> list[Page]:
    """Lay out one param group's state into pages, one run of pages per param dtype.

    Args:
        group: index of the param group.
        numels: element count of each param of the group (in group order).
        dtypes: dtype of each param.
        specs: the state arrays of the layout.
        unit: element alignment of each param's start in a page and of page splits (so
            quantization blocks never straddle params or pages).
        page_bytes: the most bytes one page may hold.
        first_index: index given to the first page.

    Returns:
        The pages, in sweep order.
    """
    cap = page_capacity(specs, unit, page_bytes)
    if cap < unit:
        need = _page_nbytes(specs, unit)[0]
        raise ValueError(
            f"page_bytes={page_bytes} cannot hold even one {unit}-element unit of state "
            f"({need} bytes); pass page_bytes >= {need} (the default is a few MiB)"
        )
    pages: list[Page] = []
    for dtype in dict.fromkeys(dtypes):  # keep first-seen order
        segs: list[Segment] = []
        fill = 0

        def close(dtype: torch.dtype = dtype) -> None:
            nonlocal segs, fill
            if segs:
                nbytes, arrays = _page_nbytes(specs, fill)
                pages.append(
                    Page(first_index + len(pages), group, dtype, fill, nbytes, arrays, segs)
                )
            segs, fill = [], 0

        for i, (n, dt) in enumerate(zip(numels, dtypes)):
            if dt != dtype or n == 0:
                continue
            start = 0
            while start < n:
                fill = -(-fill // unit) * unit
                if fill >= cap:
                    close()
                take = min(n - start, cap - fill)
                segs.append(Segment(i, start, take, fill))
                fill += take
                start += take
        close()
    return pages
