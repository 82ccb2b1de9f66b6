"""The lists an update kernel gets for one bucket of pages, cached across steps.

A bucket (pages of one group, param dtype and layout) becomes parallel lists: param views,
grad views, state views per name, step tensors, one entry per run of joined segments
(:func:`tightfit.paging.coalesce.coalesce`). With hundreds of small params (LoRA) building
them costs microseconds of Python per param every step; torch's own optimizer spends about
half that. For a bucket of resident pages everything but the grads is the same from step to
step, so it is kept in the optimizer's view cache and only the grad views are made afresh.

The cache is the optimizer's (a dict); paging only invalidates it. It is keyed by the pages'
array objects (the store makes new ones whenever a page moves; :meth:`Page.owns` tells them
from a window slot's) and which params have a gradient. The store empties it whenever pages
move or it closes (:meth:`PageStore.on_move`: it never keeps evicted memory alive), the
optimizer when its state is replaced. A param whose storage changed (``p.data = ...``) is
caught by comparing data pointers.
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit.optim.dtensor import is_dtensor, local_flat
from tightfit.paging.coalesce import coalesce
from tightfit.paging.layout import Page

_MAX_ENTRIES = 64  # resident batches per step are few (one per layout, or one per streamed page)

Group = dict[str, Any]  # a param group
Tensors = list[torch.Tensor]  # parallel flat views: params, grads, one state array or steps
StateLists = dict[str, Tensors]  # per state name, its views
Lists = tuple[Tensors, Tensors, StateLists, Tensors]  # what an update gets: see bucket_lists


def bucket_lists(
    state: dict[torch.Tensor, dict[str, Any]],
    params: list[torch.Tensor],
    bucket: list[tuple[Page, dict[str, torch.Tensor]]],
    limit: int | None,
    cache: dict[Any, Any],
) -> Lists | None:
    """``(params, grads, states, steps)`` for ``bucket``, or ``None`` when no param of it has
    a gradient.

    Args:
        state: the optimizer's per-param state (holds each param's ``step`` tensor).
        params: the group's params.
        bucket: ``(page, arrays)`` pairs of one group, param dtype and layout.
        limit: longest joined run in elements (``None``: no limit).
        cache: the optimizer's view cache.
    """
    resident = all(page.owns(arrays) for page, arrays in bucket)
    key = None
    if resident:
        key = (
            tuple(id(arrays) for _, arrays in bucket),
            tuple(params[s.param].grad is not None for page, _ in bucket for s in page.segments),
        )
        hit = cache.get(key)
        if hit is not None:
            meta, views, states, steps, ptrs = hit
            if all(p.data_ptr() == ptr for (p, _, _), ptr in zip(meta, ptrs)):
                grads = [local_flat(p.grad, a, b, in_place=False) for p, a, b in meta]
                return views, grads, states, steps
    runs = coalesce(params, bucket, limit)
    if not runs:
        return None
    views, grads, steps = [], [], []
    states: dict[str, list[torch.Tensor]] = {name: [] for name in runs[0][3]}
    for p, start, end, arrays in runs:
        views.append(local_flat(p, start, end, in_place=True))
        grads.append(local_flat(p.grad, start, end, in_place=False))
        steps.append(state[p]["step"])
        for name, view in arrays.items():
            states[name].append(view)
    if key is not None and not any(is_dtensor(p) for p, *_ in runs):  # DTensors: not cached
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        meta = [(p, a, b) for p, a, b, _ in runs]
        cache[key] = (meta, views, states, steps, [p.data_ptr() for p, _, _ in meta])
    return views, grads, states, steps
