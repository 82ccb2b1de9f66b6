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

Run = tuple[torch.Tensor, int, int, dict[str, torch.Tensor]]


def coalesce(
    params: list[torch.Tensor],
    bucket: list[tuple[Page, dict[str, torch.Tensor]]],
    limit: int | None,
) -> list[Run]:
    """The segments of ``bucket``'s pages whose param has a gradient, as
    ``(param, start, end, state views)``, joining a segment to the previous one when it
    continues the same param and its state views continue the previous ones in the same slab
    (consecutive pages of a run). Joined runs stay under ``limit`` elements."""
    # per run: param, start, end, the slab (None: cannot grow), views per name (parts)
    runs: list[tuple[torch.Tensor, int, int, object, dict[str, list[torch.Tensor]]]] = []
    for page, arrays in bucket:
        views = page.segment_views(arrays)
        slab = getattr(arrays, "slab", None)
        for k, seg in enumerate(page.segments):
            p = params[seg.param]
            if p.grad is None:
                continue
            end = seg.start + seg.length
            if runs and slab is not None:
                q, start, last_end, last_slab, parts = runs[-1]
                if (
                    q is p
                    and last_end == seg.start
                    and last_slab is slab
                    and (limit is None or end - start <= limit)
                    and all(_follows(parts[n][-1], vs[k]) for n, vs in views.items())
                ):
                    for n, vs in views.items():
                        parts[n].append(vs[k])
                    runs[-1] = (p, start, end, slab, parts)
                    continue
            runs.append((p, seg.start, end, slab, {n: [vs[k]] for n, vs in views.items()}))
    return [(p, a, b, {n: _joined(v) for n, v in parts.items()}) for p, a, b, _, parts in runs]


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether flat view ``b`` starts right where ``a`` ends (both in one slab's array)."""
    return a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """One flat view over ``parts``, consecutive views of one array (see :func:`_follows`)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return first.as_strided((sum(v.numel() for v in parts),), (1,), first.storage_offset())
