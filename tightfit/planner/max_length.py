"""How long can my sequences be? The longest sequence (largest batch) each configuration fits.

The memory model is monotone in the step's size: every term grows with the tokens (the loss
chunk and the MLP tile are sized by rules that never shrink them as the step grows:
:func:`tightfit.planner.ladder.auto_chunk_tokens` with ``monotone=True`` and
:func:`~tightfit.planner.ladder.planned_mlp_tile`), so "fits on the device and the host" is
true up to some length and false beyond. :func:`search` finds that length by doubling and
then bisection — about 2·log2(limit ÷ granularity) evaluations of the model — to the token,
or to a multiple of a granularity; the model's position limit caps a sequence.
:func:`maximize_row` is one configuration's answer (:func:`tightfit.planner.ladder.plan`
with ``maximize=`` asks it for every row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tightfit.planner.table import Row

# A batch search needs a ceiling too; no 2**20-sequence step fits any device.
MAX_BATCH = 2**20


@dataclass(frozen=True)
class Found:
    """The answer of :func:`search`.

    Attributes:
        value: The largest size that fits (a multiple of the granularity, or the cap); 0
            when not even one granularity step does.
        limit: ``"memory"`` (``value`` + granularity does not fit), ``"cap"`` (the cap
            fits), or ``"nothing fits"``.
        evaluations: How many sizes were tried.
    """

    value: int
    limit: str
    evaluations: int


def search(fits: Callable[[int], bool], *, cap: int, granularity: int = 1) -> Found:
    """The largest multiple of ``granularity`` (or ``cap`` itself) for which ``fits`` holds.

    ``fits`` must be monotone (true up to some size, false beyond); it is never called
    above ``cap``.

    Raises:
        ValueError: ``granularity`` or ``cap`` is not a positive integer.
    """
    for name, v in (("granularity", granularity), ("cap", cap)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    tried = 0

    def ok(n: int) -> bool:
        nonlocal tried
        tried += 1
        return fits(n)

    lo = min(granularity, cap)
    if not ok(lo):
        return Found(0, "nothing fits", tried)
    hi = lo
    while True:  # doubling: lo fits; find hi that does not (or the cap fitting)
        hi = min(2 * hi, cap)
        if hi == lo:
            return Found(cap, "cap", tried)
        if not ok(hi):
            break
        if hi == cap:
            return Found(cap, "cap", tried)
        lo = hi
    while hi - lo > granularity:  # bisection on multiples of the granularity
        mid = lo + max(granularity, (hi - lo) // 2 // granularity * granularity)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Found(lo, "memory", tried)


def _what_binds(row: Row) -> str:
    if row.tight:  # it fits the device only inside the safety margin
        return "device"
    if not row.fits_device and not row.fits_host:
        return "device and host"
    return "device" if not row.fits_device else "host"


def maximize_row(row_at: Callable[[int], Row], *, cap: int, granularity: int = 1,
                 what: str = "seq") -> Row:
    """The row at the largest size ``n`` (a sequence length, or a batch) that fits.

    Args:
        row_at: One configuration's row for steps of size ``n`` (``Row.fits``: device and
            host), built by rules that keep its bytes monotone in ``n``.
        cap: The largest size allowed (the model's position limit for a sequence).
        granularity: The answer is a multiple of this (or ``cap``).
        what: ``"seq"`` or ``"batch"``, for the ``limit`` text.

    Returns:
        The row at the maximum, with ``maximum`` and ``limit`` set (at the smallest size
        with ``maximum=0`` when nothing fits).
    """
    rows: dict[int, Row] = {}

    def at(n: int) -> Row:
        if n not in rows:
            rows[n] = row_at(n)
        return rows[n]

    found = search(lambda n: at(n).fits, cap=cap, granularity=granularity)
    if found.value == 0:
        return replace(at(min(granularity, cap)), maximum=0, limit="nothing fits")
    if found.limit == "cap":
        limit = (f"positions (max_position_embeddings={cap})" if what == "seq"
                 else f"the search's ceiling of {cap} sequences")
    else:
        limit = _what_binds(at(min(found.value + granularity, cap)))
    return replace(at(found.value), maximum=found.value, limit=limit)
