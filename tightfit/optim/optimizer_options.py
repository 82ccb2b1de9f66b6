"""The paging and pressure options every paged optimizer takes, defined once.

Each optimizer's constructor lists torch's own arguments first and then ``**paging``: the
keywords of :class:`PagingOptions`, handed unchanged to
:class:`~tightfit.optim.base.PagedOptimizer`, which completes them with :func:`resolve` (the
defaults, and a ``TypeError`` for a keyword that is no option) and checks their values
(:func:`tightfit.optim.checks.check_paging_options`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypedDict

from tightfit.pressure.probes import Probe

# 8 MiB: a few MiB, as the budget granularity and the 2-page streaming window want. Kernel
# cost no longer depends on it on the CPU (slabs join resident pages into one view per param;
# benchmarks/results/optimizer_pagesize.md has the fully resident step at 4/8/16 MiB).
DEFAULT_PAGE_BYTES = 8 << 20


class PagingOptions(TypedDict, total=False):
    """Paging and pressure keywords of every paged optimizer (all optional, keyword-only).

    Attributes:
        page_bytes: the most bytes one page holds (default 8 MiB).
        device_budget: bytes of state allowed on the params' device (``None``: no limit).
        host_budget: bytes of state in host RAM when the params are on an accelerator
            (``None``: no limit; ignored on the CPU, where the next tier is disk).
        spill_dir: folder for the spill files (a private subfolder is made and removed on
            close); ``None``: the system temp folder.
        target: keep the device's total usage (as ``probe`` reads it) under this: a fraction
            of capacity (float, e.g. 0.9) or bytes (int; required on the CPU). Pages leave the
            device when usage passes it and come back at later steps; ``None`` with no
            ``probe``: no pressure handling (see ``docs/pressure.md``).
        probe: reads the device's usage (``None``: CudaProbe on CUDA; on the CPU CgroupProbe under a
            memory cgroup with a limit, else RSSProbe).
    """

    page_bytes: int
    device_budget: int | None
    host_budget: int | None
    spill_dir: str | os.PathLike | None
    target: float | int | None
    probe: Probe | None


# The value of each option when it is not given; the keys are PagingOptions' own (a test
# checks that the two agree).
DEFAULTS: PagingOptions = {
    "page_bytes": DEFAULT_PAGE_BYTES,
    "device_budget": None,
    "host_budget": None,
    "spill_dir": None,
    "target": None,
    "probe": None,
}


def resolve(owner: str, given: Mapping[str, Any]) -> PagingOptions:
    """The options of ``given`` with the missing ones at their defaults (values unchecked).

    Args:
        owner: the optimizer's class name, for the messages.
        given: the keywords the constructor received beyond its own arguments.

    Raises:
        TypeError: a keyword that is no paging option (Python's own message for an
            unexpected keyword argument, plus the options there are).
    """
    unknown = [name for name in given if name not in DEFAULTS]
    if unknown:
        raise TypeError(
            f"{owner}.__init__() got an unexpected keyword argument {unknown[0]!r}; its "
            f"paging options are {', '.join(DEFAULTS)} (see tightfit.optim.optimizer_options.PagingOptions)"
        )
    return {**DEFAULTS, **given}  # type: ignore[return-value,typeddict-item]
