"""tightfit.paging: the page store of optimizer state, and where each page lives.

Here:
    paging_options: ``PagingOptions`` (page size, device and host budgets, spill folder),
        checked once when made; ``DEFAULT_PAGE_BYTES``.
    layout: ``Page``, ``StateSpec``, ``build_pages``: a param group's state cut into pages.
    store: ``PageStore``, which page is on which tier within the budgets; the moves, the
        traffic counters, and the device limit pressure lowers and raises.
    residency: ``plan_tiers``, a fixed resident prefix of the sweep order, the rest streamed.
    sweep: the step's sweep over the pages, and its crash-consistency rule.
    slab: the CPU device tier as slabs (one array per state name for a run of pages).
    coalesce: views of adjacent resident pages joined into one run per param.
    disk: pages on the disk tier: room reserved first, files checked, bytes checksummed.
    events: ``EventLog`` and ``PagingCounters``, what moved and why.

May import measure, integrity and tiers (model, loss and checkpoint sit below it too, unused).
The entry point is ``PageStore(device, PagingOptions(...))``, made by the paged optimizer
(:mod:`tightfit.optim.base`); users see it as ``optimizer.pager``.
"""
