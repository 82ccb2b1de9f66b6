"""tightfit.pressure: how full the device is, and what the paged optimizer does about it.

Here:
    probes: ``Probe`` and its kinds (CUDA, process RSS, memory cgroup); ``machine_room``.
    cgroup: the memory cgroup's limit and usage (v1 and v2).
    highwater: a probe's high-water mark between steps.
    target: ``default_target`` and the target's forms (fraction, bytes, "auto", None).
    occupancy: ``OccupancyControl``, which keeps the device under the target by evicting and
        restoring pages of :mod:`tightfit.paging`'s store; ``recover_from_oom``.
    watch: ``PressureWatch``, hooks on the model's blocks that see an activation spike coming.

May import measure, model, integrity, tiers and paging. The entry point for users is
``optimizer_for(..., target=...)``; ``OccupancyControl`` and ``PressureWatch`` are public for
those who build an optimizer themselves.
"""
