"""How many bytes a step could still add on a device: what long-step planning plans against.

On CUDA that is the free memory (the allocator's cached part included) within a per-process
memory fraction when one is set; on the CPU the memory cgroup's room or the RAM available,
whichever is smaller. :func:`tightfit.prepare` reads it once and hands the number to
:func:`tightfit.checkpoint.long_step.plan_activations`.
"""

from __future__ import annotations

import psutil
import torch

from tightfit.checkpoint.long_step import Room
from tightfit.measure.sizes import format_bytes
from tightfit.pressure.probes import RSSProbe, cgroup_memory_limit
from tightfit.tiers.regions import meminfo


def machine_room(dev: torch.device) -> Room:
    """Bytes a step could add on ``dev`` now (see the module docstring)."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        room = free + torch.cuda.memory_reserved(dev) - allocated
        limit = "the CUDA device's free memory"
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if callable(fraction) and int(fraction(dev) * total) - allocated < room:
            room = int(fraction(dev) * total) - allocated
            limit = f"this process's CUDA memory fraction ({fraction(dev):g} of the device)"
        return Room(max(0, int(room)), limit)
    available = mem_available()
    rooms = [Room(max(0, available), "the RAM available (MemAvailable)")]
    cap = cgroup_memory_limit()
    if cap is not None:
        used = RSSProbe().used_bytes()
        rooms.append(Room(max(0, cap - used), f"the memory cgroup's limit ({format_bytes(cap)}) "
                                              f"less the {format_bytes(used)} this process uses"))
    return min(rooms, key=lambda r: r.bytes)


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, else psutil's figure (not Linux)."""
    if (available := meminfo().get("MemAvailable")) is not None:
        return available
    return int(psutil.virtual_memory().available)
