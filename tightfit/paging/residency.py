"""Which pages stay on the device: a fixed prefix of the sweep order, the rest streamed.

The step is a cyclic sweep over all pages; with K of N pages fitting, LRU evicts each page just
before it is needed again and every page moves every step. A fixed resident set (any fixed set
works; a prefix of the sweep order is the simplest) with the other N−K pages streamed through a
small window moves the minimum: 2 × the non-resident bytes per step.
"""

from __future__ import annotations

from tightfit.paging.layout import Page
from tightfit.paging.paging_options import PagingOptions

WINDOW_SLOTS = 2  # current page + one being prefetched


def plan_tiers(
    pages: list[Page], limit: int | None, options: PagingOptions, on_cpu: bool
) -> tuple[list[str], int]:
    """Target tier of every page and the number of window slots.

    Args:
        pages: every page, in sweep order.
        limit: bytes of state allowed on the device, window included (``None``: no limit);
            ``options.device_budget`` or less, as pressure lowers it.
        options: the store's options; their ``host_budget`` bounds the host tier (``None``:
            no limit; unused on the CPU).
        on_cpu: device and host are one tier, so the next tier is disk.

    Returns:
        ``(tiers, slots)``: ``"device"``, ``"host"`` or ``"disk"`` per page, and the window
        slots (0 when everything is resident).
    """
    total = sum(p.nbytes for p in pages)
    if limit is None or total <= limit:
        return ["device"] * len(pages), 0
    biggest = max(p.nbytes for p in pages)
    slots = max(1, min(WINDOW_SLOTS, limit // biggest))
    room = limit - slots * biggest
    host_room = options.host_budget
    tiers = []
    for page in pages:
        if page.nbytes <= room:
            tiers.append("device")
            room -= page.nbytes
        elif on_cpu:
            tiers.append("disk")
        elif host_room is None or page.nbytes <= host_room:
            tiers.append("host")
            if host_room is not None:
                host_room -= page.nbytes
        else:
            tiers.append("disk")
    return tiers, slots
