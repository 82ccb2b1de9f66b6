"""tightfit.measure: live-byte tracking (CPU and CUDA), byte sizes and dtype names; lowest level.

Here:
    tracker: ``MemoryTracker``, peak live tensor bytes on the CPU or CUDA, with phase marks;
        ``external_allocated``/``external_freed`` for bytes torch does not see.
    sizes: ``parse_bytes``/``format_bytes``, sizes as people write them ("24GiB", "512MiB").
    dtypes: the dtype names of the CLI, the planner and the Python API (``torch_dtype``).
    cgroup: the memory cgroup that limits this process: its limit, charge and the room
        left (v1 and v2); the pressure probes and the pinned host tier read it.
    heap: ``trim_heap``, freed heap pages back to the OS (glibc's ``malloc_trim``), so a
        tier's freed bytes leave the RSS a probe or cgroup sees.

Imports nothing of tightfit: every other folder may import it. Entry point:
:class:`tightfit.MemoryTracker` (:class:`tightfit.measure.tracker.MemoryTracker`).
"""
