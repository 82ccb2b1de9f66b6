"""One optimizer step as a sweep over pages: resident pages in one batch, the rest streamed.

The sweep starts loading the first streamed pages into the window, then walks the streamed
pages: wait for page *i*, update it, write it back, start loading page *i + slots* into the freed
slot. The resident pages are updated in batched calls spread between the streamed pages (one
call per layout when nothing streams), so the copies run behind compute the whole time.

Progress is recorded per page, so that a sweep that stops part-way — an error, an
out-of-memory, a Ctrl-C — leaves every page either untouched or done (its update applied, the
page marked with the step id, its write-back queued), and running the sweep again for the same
step updates only the pages not yet done, each exactly once. Two things make that hold:

* Ctrl-C is held for the whole sweep (:mod:`tightfit.integrity.interrupts`) and delivered only
  between pages, never between a kernel returning and its page being marked;
* once an update returned, whatever goes wrong next (marking, queuing the write-back) the page
  is marked and its write-back made before the error goes on (:func:`_commit`).

An update that raises must have changed nothing (torch's fused kernels check and allocate
before they write), as for an out-of-memory error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tightfit.integrity.checksums import copy_threads
from tightfit.integrity.interrupts import hold_interrupts
from tightfit.paging.layout import Page
from tightfit.paging.store import PageStore
from tightfit.tiers.copy import write_home

UpdateFn = Callable[[list[tuple[Page, dict[str, torch.Tensor]]]], None]


def sweep(store: PageStore, pages: list[Page], step_id: int, update: UpdateFn) -> None:
    """Update each page in ``pages`` exactly once for step ``step_id``.

    Args:
        store: the page store (residency, window slots, copy engine, counters).
        pages: the pages holding state of params that have a gradient this step.
        step_id: id of the step; pages already marked with it are skipped.
        update: called with ``(page, arrays)`` pairs of one layout (group, param dtype and
            state arrays) whose arrays (state name -> flat typed view) are on the device; it
            updates params and state in place, or raises having changed nothing.
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

    # On the CPU the streamed pages' copies (and their checksums) get cores of their own,
    # off the update's path, while any is in flight (CopyEngine.beside_copies says why). At
    # most a window's worth of copies is in flight, so an update of more bytes than the
    # window outlasts them: it keeps every thread (a batch of resident pages when few stream)
    busy = copy_threads(max(p.nbytes for p in streamed)) if streamed and store.on_cpu else 0
    window = sum(slot.numel() for slot in slots)

    def update_beside(items: list[tuple[Page, dict[str, torch.Tensor]]]) -> None:
        nbytes = sum(page.nbytes for page, _ in items)
        with engine.beside_copies(busy if nbytes <= window else 0):
            update(items)

    # Resident work is spread between the streamed pages, so the copies always have compute
    # to hide behind (one batch before the first streamed page, one after each).
    chunks = _split(resident, len(streamed) + 1)

    def update_resident(chunk: list[Page]) -> None:
        # One call per layout (group, param dtype, arrays), each marked as soon as it is done:
        # the update makes one kernel call per layout, so an error in a later call must not
        # leave earlier, already updated pages unmarked (a retry would update them twice).
        for part in _by_layout(chunk):
            update_beside([(p, store.arrays(p)) for p in part])
            _commit(store, part, step_id)

    with hold_interrupts() as hold:
        try:
            for i in range(min(len(slots), len(streamed))):
                start_load(i)
            update_resident(chunks[0])
            hold.deliver()  # a safe point: every page is untouched or done
            for i, page in enumerate(streamed):
                slot = slots[i % len(slots)][: page.nbytes]
                counters.stall_seconds += engine.wait(handles.pop(i))
                update_beside([(page, page.array_views(slot))])
                _commit(store, [page], step_id, slot)
                if i + len(slots) < len(streamed):
                    start_load(i + len(slots))
                update_resident(chunks[i + 1])
                hold.deliver()
        finally:
            # Write-backs of updated pages must land even when a later page failed.
            counters.stall_seconds += engine.drain()


def mark_done(pages: list[Page], step_id: int) -> None:
    """Record that ``pages`` hold step ``step_id``'s update (a resident page's spill copy, if
    any, is stale from now on; a streamed page's is rewritten by its write-back)."""
    for page in pages:
        page.updated_step = step_id
        page.spill_valid = page.tier == "disk"


def write_back(store: PageStore, page: Page, slot: torch.Tensor) -> None:
    """Queue a streamed page's write-back from its window slot to its home."""
    store.engine.store(slot, store.home(page))
    store.counters.bytes_paged_out += page.nbytes


def _commit(
    store: PageStore, pages: list[Page], step_id: int, slot: torch.Tensor | None = None
) -> None:
    """Mark ``pages`` (their update just returned) and, for a streamed page, queue its
    write-back from ``slot``. If either fails, the pages are still marked and the write-back
    is made here and now before the error goes on: the update already happened, so redoing it
    would apply it twice, and dropping the slot's bytes would lose it."""
    queued = False
    try:
        mark_done(pages, step_id)
        if slot is not None:
            write_back(store, pages[0], slot)
            queued = True
    except BaseException:
        for page in pages:
            page.updated_step = step_id
        if slot is not None and not queued:
            # No other copy of this slot's bytes to this home is pending (each page is written
            # back once per sweep), so a direct write cannot overtake one. A failure here marks
            # a disk page lost (tightfit.paging.disk): a later read says so, never silent.
            page = pages[0]
            page.spill_valid = page.tier == "disk"
            write_home(store.home(page), slot if slot.device.type == "cpu" else slot.cpu())
            store.counters.bytes_paged_out += page.nbytes
        raise


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
