"""One optimizer step as a sweep over pages: resident pages in one batch, the rest streamed.

The sweep starts loading the first streamed pages into the window, then walks the streamed
pages: wait for page *i*, update it, write it back, start loading page *i + slots* into the freed
slot. The resident pages are updated in batched calls spread between the streamed pages (one
call per layout when nothing streams), so the copies run behind compute the whole time. Each page is
marked with the step id once updated, so a sweep that stops part-way (an error, an
out-of-memory) can be run again for the same step and updates only the pages it had not done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tightfit.paging.layout import Page
from tightfit.paging.store import PageStore

UpdateFn = Callable[[list[tuple[Page, dict[str, torch.Tensor]]]], None]


def sweep(store: PageStore, pages: list[Page], step_id: int, update: UpdateFn) -> None:
    """Update each page in ``pages`` exactly once for step ``step_id``.

    Args:
        store: the page store (residency, window slots, copy engine, counters).
        pages: the pages holding state of params that have a gradient this step.
        step_id: id of the step; pages already marked with it are skipped.
        update: called with ``(page, arrays)`` pairs of one layout (group, param dtype and
            state arrays) whose arrays (state name -> flat typed view) are on the device; it
            updates params and state in place.
    """
    todo = [p for p in pages if p.updated_step != step_id]
    resident = [p for p in todo if p.tier == "device"]
    streamed = [p for p in todo if p.tier != "device"]
    if streamed and not store.slots:
        raise RuntimeError("pages are off the device but the store has no window slots")
    engine, slots, counters = store.engine, store.slots, store.counters
    handles: dict[int, object] = {}

    def start_load(i: int) -> None:
        page = streamed[i]
        slot = slots[i % len(slots)][: page.nbytes]
        handles[i] = engine.load(store.home(page), slot)
        counters.bytes_paged_in += page.nbytes
        counters.page_faults += 1

    # Resident work is spread between the streamed pages, so the copies always have compute
    # to hide behind (one batch before the first streamed page, one after each).
    chunks = _split(resident, len(streamed) + 1)

    def update_resident(chunk: list[Page]) -> None:
        # One call per layout (group, param dtype, arrays), each marked as soon as it is done:
        # the update makes one kernel call per layout, so an error in a later call must not
        # leave earlier, already updated pages unmarked (a retry would update them twice).
        for part in _by_layout(chunk):
            update([(p, store.arrays(p)) for p in part])
            for p in part:
                p.updated_step = step_id
                p.spill_valid = False

    try:
        for i in range(min(len(slots), len(streamed))):
            start_load(i)
        update_resident(chunks[0])
        for i, page in enumerate(streamed):
            slot = slots[i % len(slots)][: page.nbytes]
            counters.stall_seconds += engine.wait(handles.pop(i))
            update([(page, page.array_views(slot))])
            page.updated_step = step_id
            page.spill_valid = page.tier == "disk"  # its home is rewritten just below
            # Only updated pages are written back: a page without gradients is never loaded.
            engine.store(slot, store.home(page))
            counters.bytes_paged_out += page.nbytes
            if i + len(slots) < len(streamed):
                start_load(i + len(slots))
            update_resident(chunks[i + 1])
    finally:
        # Write-backs of updated pages must land even when a later page failed.
        counters.stall_seconds += engine.drain()


def _by_layout(pages: list[Page]) -> list[list[Page]]:
    """``pages`` grouped by (group, param dtype, state arrays), first-seen order kept."""
    out: dict[tuple, list[Page]] = {}
    for page in pages:
        out.setdefault((page.group, page.dtype, tuple(page.arrays)), []).append(page)
    return list(out.values())


def _split(items: list[Page], parts: int) -> list[list[Page]]:
    """``items`` cut into ``parts`` runs of near-equal length (order kept)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + q + (1 if k < r else 0)
        out.append(items[start:end])
        start = end
    return out
