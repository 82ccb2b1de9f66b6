"""The lists an update kernel gets for one bucket of pages, cached across steps.

A bucket (pages of one group, param dtype and layout) becomes parallel lists: param views,
grad views, state views per name, step tensors, one entry per run of joined segments
(:func:`tightfit.paging.coalesce.coalesce`). With hundreds of small params (LoRA) building
them costs microseconds of Python per param every step; torch's own optimizer spends about
half that. For a bucket of resident pages everything but the grads is the same from step to
step, so it is kept in the optimizer's view cache and only the grad views are made afresh.

The cache is the optimizer's (a :class:`ViewCache`); paging only invalidates it. It is keyed by the pages'
array objects (the store makes new ones whenever a page moves; :meth:`Page.owns` tells them
from a window slot's) and which params have a gradient. The store empties it whenever pages
move or it closes (:meth:`PageStore.on_move`: it never keeps evicted memory alive), the
optimizer when its state is replaced. A param whose storage changed (``p.data = ...``) is
caught by comparing data pointers. It holds at least as many entries as the last step looked up
buckets (the sweep makes one resident bucket per streamed page), least recently used out
first, so a step with many buckets finds every one again the next step. Params whose memory is not in page order (see
:mod:`tightfit.optim.element_order`) are updated through staging copies made for the one update, so a
bucket holding one is never cached.
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit.optim.dtensor import is_dtensor, local_flat
from tightfit.optim.element_order import PLAIN, ElementOrder
from tightfit.paging.coalesce import coalesce
from tightfit.paging.layout import Page

_MIN_ENTRIES = 64  # kept however few buckets a step has (one per layout, or per streamed page)

Group = dict[str, Any]  # a param group
Tensors = list[torch.Tensor]  # parallel flat views: params, grads, one state array or steps
StateLists = dict[str, Tensors]  # per state name, its views
Lists = tuple[Tensors, Tensors, StateLists, Tensors]  # what an update gets: see bucket_lists


class ViewCache(dict):
    """The optimizer's cached update lists: a dict that keeps as many entries as a step has
    buckets (at least ``_MIN_ENTRIES``), evicting the least recently used."""

    def __init__(self) -> None:
        super().__init__()
        self._step: int | None = None
        self._this = self._last = 0  # buckets looked up this step, in the last

    def for_step(self, step_id: int) -> ViewCache:
        """Count one bucket's lookup in step ``step_id``; returns the cache."""
        if step_id != self._step:
            self._step, self._last, self._this = step_id, self._this, 0
        self._this += 1
        return self

    @property
    def limit(self) -> int:
        return max(_MIN_ENTRIES, self._this, self._last)


def bucket_lists(
    state: dict[torch.Tensor, Any],
    params: list[torch.Tensor],
    bucket: list[tuple[Page, dict[str, torch.Tensor]]],
    limit: int | None,
    cache: dict[Any, Any],
    orders: dict[int, ElementOrder] | None = None,
    staged: dict[int, torch.Tensor] | None = None,
) -> Lists | None:
    """``(params, grads, states, steps)`` for ``bucket``, or ``None`` when no param of it has
    a gradient.

    Args:
        state: the optimizer's per-param state (holds each param's ``step`` tensor).
        params: the group's params.
        bucket: ``(page, arrays)`` pairs of one group, param dtype and layout.
        limit: longest joined run in elements (``None``: no limit).
        cache: the optimizer's view cache.
        orders: each param's element order by ``id`` (:mod:`tightfit.optim.element_order`; missing:
            row-major, real).
        staged: flat staging copies (page order) by ``id`` of the params whose memory is not
            in page order; their views are taken from these (and never cached).
    """
    orders = orders or {}
    staged = staged or {}
    resident = all(page.owns(arrays) for page, arrays in bucket)
    key = None
    if resident and not staged:
        key = (
            tuple(id(arrays) for _, arrays in bucket),
            tuple(params[s.param].grad is not None for page, _ in bucket for s in page.segments),
        )
        hit = cache.pop(key, None)
        if hit is not None:
            cache[key] = hit  # the most recently used: evicted last
            meta, views, states, steps, ptrs, plain = hit
            if all(p.data_ptr() == ptr for (p, _, _, _), ptr in zip(meta, ptrs)):
                if plain:  # the common case, without a call per param
                    grads = [local_flat(p.grad, a, b, in_place=False) for p, a, b, _ in meta]
                else:
                    grads = [_grad(p, a, b, o) for p, a, b, o in meta]
                return views, grads, states, steps
    runs = coalesce(params, bucket, limit)
    if not runs:
        return None
    views, grads, steps, meta = [], [], [], []
    states: dict[str, list[torch.Tensor]] = {name: [] for name in runs[0][3]}
    for p, start, end, arrays in runs:
        order = orders.get(id(p), PLAIN)
        meta.append((p, start, end, order))
        if order.plain and id(p) not in staged:
            views.append(local_flat(p, start, end, in_place=True))
        else:
            flat = staged.get(id(p))
            flat = order.view(p) if flat is None else flat
            views.append(flat[start:end])
        grads.append(_grad(p, start, end, order))
        steps.append(state[p]["step"])
        for name, view in arrays.items():
            states[name].append(view)
    if key is not None and not any(is_dtensor(p) for p, *_ in runs):  # DTensors: not cached
        limit = cache.limit if isinstance(cache, ViewCache) else _MIN_ENTRIES
        while len(cache) >= limit:
            del cache[next(iter(cache))]  # the least recently used
        plain = all(o.plain for *_, o in meta)
        cache[key] = (meta, views, states, steps, [p.data_ptr() for p, *_ in meta], plain)
    return views, grads, states, steps


def _grad(p: torch.Tensor, start: int, end: int, order: ElementOrder) -> torch.Tensor:
    """Elements ``start:end`` of ``p``'s grad in page order (a view where possible)."""
    if order.plain:
        return local_flat(p.grad, start, end, in_place=False)
    return order.flat(p.grad)[start:end]


def staging(
    params: list[torch.Tensor],
    bucket: list[tuple[Page, dict[str, torch.Tensor]]],
    maybe: set[int],
    orders: dict[int, ElementOrder],
) -> dict[int, torch.Tensor]:
    """Contiguous copies (page order) of the bucket's params with a gradient whose memory is
    not in page order, by ``id``; ``maybe`` holds the ids of the params that can be such."""
    out: dict[int, torch.Tensor] = {}
    if not maybe:
        return out
    for page, _ in bucket:
        for seg in page.segments:
            p = params[seg.param]
            if id(p) in maybe and p.grad is not None and id(p) not in out:
                order = orders.get(id(p), PLAIN)
                if order.view(p) is None:
                    out[id(p)] = order.flat(p).clone()
    return out


def unstage(
    params: list[torch.Tensor], staged: dict[int, torch.Tensor], orders: dict[int, ElementOrder]
) -> None:
    """Write the updated staging copies back into their params."""
    if not staged:
        return
    for p in params:
        flat = staged.get(id(p))
        if flat is not None:
            ordered = orders.get(id(p), PLAIN).ordered(p)
            ordered.copy_(flat.view(ordered.shape))
