"""The page store's options, defined and checked once: :class:`PagingOptions`.

One object carries them from where they are given (``tightfit train``'s flags, through
:class:`~tightfit.optim.optimizer_options.OptimizerOptions`; a paged optimizer's keywords) to
the store (:class:`~tightfit.paging.store.PageStore`) and its residency plan
(:func:`~tightfit.paging.residency.plan_tiers`), unchanged on the way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tightfit.tiers.spill import check_spill_dir

# 8 MiB: a few MiB, as the budget granularity and the 2-page streaming window want. Kernel
# cost no longer depends on it on the CPU (slabs join resident pages into one view per param;
# benchmarks/results/optimizer_pagesize.md has the fully resident step at 4/8/16 MiB).
DEFAULT_PAGE_BYTES = 8 << 20


def _check_bytes(name: str, value: Any, page_bytes: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} is negative; pass a byte count >= 0 or None")
    if value < page_bytes:
        raise ValueError(
            f"{name}={value} is below one page (page_bytes={page_bytes}); pass at least "
            f"{page_bytes} bytes, lower page_bytes, or pass None for no limit"
        )


@dataclass(frozen=True)
class PagingOptions:
    """Where a paged optimizer's state may live: page size, tier budgets, spill folder.

    Checked when made (a ``ValueError``/``TypeError`` naming the value and the fix, before
    any page or spill folder exists); never checked again downstream.

    Attributes:
        page_bytes: the most bytes one page holds (default 8 MiB).
        device_budget: bytes of state allowed on the params' device (``None``: no limit);
            at least one page.
        host_budget: bytes of state in host RAM when the params are on an accelerator
            (``None``: no limit; ignored on the CPU, where the next tier is disk); at least
            one page.
        spill_dir: folder for the spill files (a private subfolder is made and removed on
            close); ``None``: the system temp folder. Made if missing, and must be writable.
    """

    page_bytes: int = DEFAULT_PAGE_BYTES
    device_budget: int | None = None
    host_budget: int | None = None
    spill_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        page_bytes = self.page_bytes
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes={page_bytes!r} must be a positive int (e.g. 4 << 20)")
        _check_bytes("device_budget", self.device_budget, page_bytes)
        _check_bytes("host_budget", self.host_budget, page_bytes)
        check_spill_dir(self.spill_dir)
