"""tightfit.tiers: the places bytes live (device, host, disk) and the engines that move them.

Here:
    copy: ``CopyEngine``/``CudaCopyEngine``: copies between a home (host buffer, spill map)
        and a device slot: a worker thread for the spill map, a CUDA side stream with events.
    copy_queue: ``CopyQueue``, the in-order queue of copies the CPU engine's worker (or the
        thread waiting for one) runs.
    regions: ``RegionPool`` of pinned host or disk regions (offloaded activations' homes,
        the paged optimizer's host pages), ``tier_capacity``.
    pinned: ``PinnedHost``, the one place host memory is pinned (registered buffers,
        counted against one budget and the machine's room), ``TierFullError``, ``meminfo``.
    streams: ``copy_stream``, the engines' dedicated side stream per device and role.
    spill: ``SpillArea``, memory-mapped spill files under a private folder; ``check_spill_dir``.

May import measure, model and integrity (it uses measure, and integrity's owner files for
its spill folders).
Below both of its users: the paged optimizers' state (:mod:`tightfit.paging`) and offloaded
activations (:mod:`tightfit.checkpoint.offload`) move through the same copy engines and
spill files. No user entry point: the folders above build engines and pools from it.
"""
