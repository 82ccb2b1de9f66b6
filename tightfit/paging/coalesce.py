"""Join the page views of a param that continue each other in memory into one view.

On a slab (the CPU device tier, :mod:`tightfit.paging.slab`) a param split over resident pages
has its state arrays back to back, so its segments can be handed to the kernel as one view: a
fully resident step then calls torch's fused kernel once per param, as ``torch.optim.AdamW``
does. Elsewhere (one buffer per page, window slots) views never continue each other, so nothing
is joined; joining is decided by memory, never assumed from the layout.
"""

from __future__ import annotations

import torch

from tightfit.paging.layout import Page


def coalesce(
    params: list[torch.Tensor],
    bucket: list[tuple[Page, dict[str, torch.Tensor]]],
    limit: int | None,
) -> list[tuple[torch.Tensor, int, int, dict[str, torch.Tensor]]]:
    """The segments of ``bucket``'s pages whose param has a gradient, as
    ``(param, start, end, state views)``, joining a segment to the previous one when it
    continues the same param and every state view continues the previous one in memory
    (pages next to each other in a slab). Joined runs stay under ``limit`` elements."""
    runs: list[tuple[torch.Tensor, int, int, dict[str, torch.Tensor]]] = []
    for page, arrays in bucket:
        views = page.segment_views(arrays)
        for k, seg in enumerate(page.segments):
            p = params[seg.param]
            if p.grad is None:
                continue
            mine = {name: vs[k] for name, vs in views.items()}
            end = seg.start + seg.length
            if runs:
                q, start, last_end, last = runs[-1]
                if (
                    q is p
                    and last_end == seg.start
                    and (limit is None or end - start <= limit)
                    and all(_follows(last[n], v) for n, v in mine.items())
                ):
                    runs[-1] = (p, start, end, {n: _join(last[n], v) for n, v in mine.items()})
                    continue
            runs.append((p, seg.start, end, mine))
    return runs


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether flat view ``b`` starts right where flat view ``a`` ends, in the same memory."""
    return (
        a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() + a.numel() == b.storage_offset()
    )


def _join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One flat view over ``a`` then ``b`` (which :func:`_follows` it)."""
    return a.as_strided((a.numel() + b.numel(),), (1,), a.storage_offset())
