"""bf16/fp16 params with fp32 state: the update runs on fp32 copies, a page's worth at a time.

torch's fused Adam/AdamW kernels (CPU and CUDA, torch 2.13) take every list in the param's
dtype (``_fused_adamw_`` on a bf16 param with fp32 moments raises "expected scalar type
BFloat16 but found Float"), and torch's own AdamW on bf16 params keeps bf16 moments. State here
is fp32, so a low-precision bucket is updated through fp32 copies of its params and grads,
rounded once into the params. Copying the whole bucket at once is 8 bytes per element on the
device outside every budget (when nothing streams, a bucket is every resident page of a
layout); here the bucket is cut into runs of whole pages of at most one page's elements, and
the copies of one run at a time live in one scratch buffer, :func:`scratch_bytes` long, that
the page store plans inside the device budget (``PageStore.scratch_bytes``).

The sweep's rule (an update that raises changed nothing) then holds per run: the scratch is
allocated before anything is written, and when a later run raises, the pages of the runs
already done are reported to ``done`` (the optimizer marks them updated) so a retry skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tightfit.optim.update_lists import Lists, StateLists, Tensors
from tightfit.paging.layout import Page
from tightfit.paging.store import PageStore

LOW_PRECISION = (torch.bfloat16, torch.float16)
COPY_BYTES = 8  # per element: an fp32 copy of the param and one of its grad

Item = tuple[Page, dict[str, torch.Tensor]]


def scratch_bytes(pages: Iterable[Page]) -> int:
    """Device bytes the fp32 copies need: ``COPY_BYTES`` × the largest low-precision page's
    elements (0 without one)."""
    return COPY_BYTES * max((p.elements for p in pages if p.dtype in LOW_PRECISION), default=0)


def plan_scratch(store: PageStore) -> None:
    """Plan the fp32 copies of ``store``'s bf16/fp16 pages inside its device budget (its
    ``scratch_bytes``); raises ``ValueError`` before anything changes when the budget cannot
    hold them beside one page."""
    need = scratch_bytes(store.pages)
    if need == store.scratch_bytes:
        return
    biggest = max(p.nbytes for p in store.pages)
    budget = store.device_budget
    if budget is not None and budget < biggest + need:
        raise ValueError(
            f"device_budget={budget} cannot hold one page ({biggest} bytes) and the fp32 copies "
            f"bf16/fp16 params are updated through ({need} bytes: {COPY_BYTES} per element of "
            f"a page); pass device_budget >= {biggest + need} or a smaller page_bytes"
        )
    store.scratch_bytes = need
    if store.materialized:
        store.apply_plan("fp32 copies of bf16/fp16 params planned")


def runs(items: list[Item]) -> list[list[Item]]:
    """``items`` cut into runs of consecutive pages of at most the largest page's elements."""
    most = max(page.elements for page, _ in items)
    out: list[list[Item]] = []
    size = most + 1
    for item in items:
        if size + item[0].elements > most:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[0].elements
    return out


def update_in_runs(
    items: list[Item],
    lists: Callable[[list[Item]], Lists | None],
    update: Callable[[Tensors, Tensors, StateLists, Tensors], None],
    *,
    grad_scale: torch.Tensor | None,
    done: Callable[[list[Page]], None],
) -> None:
    """Update the low-precision bucket ``items`` a run of pages at a time through fp32 copies.

    Args:
        items: ``(page, arrays)`` pairs of one layout (bf16 or fp16 params).
        lists: a run's update lists (:func:`tightfit.optim.update_lists.bucket_lists`), or
            ``None`` when no param of it has a gradient.
        update: the fp32 update of one run's lists (params, grads, states, steps), in place.
        grad_scale: divide the grads by it first (``None``: the update unscales, or no AMP).
        done: called with the pages of the runs already updated when a later one raises.
    """
    most = max(page.elements for page, _ in items)
    scratch: torch.Tensor | None = None
    finished: list[Page] = []
    try:
        for run in runs(items):
            got = lists(run)
            if got is not None:
                flat, grads, states, steps = got
                if scratch is None:  # one allocation, before anything is written
                    scratch = torch.empty(2 * most, dtype=torch.float32, device=flat[0].device)
                sizes = [v.numel() for v in flat]
                n = sum(sizes)
                p32 = list(scratch[:n].split(sizes))
                g32 = list(scratch[most:most + n].split(sizes))
                torch._foreach_copy_(p32, flat)
                torch._foreach_copy_(g32, grads)
                if grad_scale is not None:
                    torch._foreach_div_(g32, grad_scale.to(g32[0].device))
                update(p32, g32, states, steps)
                torch._foreach_copy_(flat, p32)  # rounded once into the params
            finished += [page for page, _ in run]
    except BaseException:
        if finished:
            done(finished)
        raise
