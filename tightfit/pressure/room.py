"""How many bytes a step could still add on a device: what long-step planning plans against.

On CUDA that is the free memory (the allocator's cached part included) within a per-process
memory fraction when one is set; on the CPU the memory cgroup's room or the RAM available,
whichever is smaller. :func:`tightfit.prepare` reads it once and hands the number to
:func:`tightfit.checkpoint.long_step.plan_activations`.
"""

from __future__ import annotations

import psutil
import torch

from tightfit.pressure.probes import RSSProbe, cgroup_memory_limit
from tightfit.tiers.regions import meminfo


def machine_room(dev: torch.device) -> int:
    """Bytes a step could add on ``dev`` now (see the module docstring)."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        room = free + torch.cuda.memory_reserved(dev) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if callable(fraction):
            room = min(room, int(fraction(dev) * total) - allocated)
        return int(room)
    rooms = [mem_available()]
    limit = cgroup_memory_limit()
    if limit is not None:
        rooms.append(limit - RSSProbe().used_bytes())
    return max(0, min(rooms))


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, else psutil's figure (not Linux)."""
    if (available := meminfo().get("MemAvailable")) is not None:
        return available
    return int(psutil.virtual_memory().available)
