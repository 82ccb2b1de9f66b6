"""How many bytes a step could still add on a device: what long-step planning plans against.

On CUDA that is what :class:`~tightfit.pressure.probes.CudaProbe` reads as free: within the
per-process memory fraction, the allocator's whole free segments included, the holes of split
segments not; on the CPU the memory cgroup's room (its limit less its charge without page
cache) or the RAM available, whichever is smaller. :func:`tightfit.prepare` reads it once and hands the ``Room`` to
:func:`tightfit.checkpoint.long_step.plan_activations`.
"""

from __future__ import annotations

import psutil
import torch

from tightfit.checkpoint.long_step import Room
from tightfit.measure.cgroup import cgroup_room, limiting_cgroup
from tightfit.measure.sizes import format_bytes
from tightfit.pressure.probes import CudaProbe
from tightfit.tiers.pinned import meminfo


def machine_room(dev: torch.device) -> Room:
    """Bytes a step could add on ``dev`` now (see the module docstring)."""
    if dev.type == "cuda":
        # the pressure probe's reading: the per-process fraction, and no credit for the holes
        # of split cached segments (a large request cannot use them)
        probe = CudaProbe(dev)
        cap, total = probe.capacity_bytes(), int(torch.cuda.mem_get_info(probe.device)[1])
        limit = ("the CUDA device's free memory" if cap >= total else
                 f"this process's CUDA memory fraction ({cap / total:.2g} of the device)")
        return Room(max(0, cap - probe.used_bytes()), limit)
    available = mem_available()
    rooms = [Room(max(0, available), "the RAM available (MemAvailable)")]
    cg = limiting_cgroup()
    left = cgroup_room(cg)
    if cg is not None and cg.limit is not None and left is not None:
        # what the kernel compares with the limit: the cgroup's charge less its page cache
        # (measure.cgroup); not the RSS, which counts library pages another cgroup was charged
        # for (170 MiB of torch's and transformers' in benchmarks/results/long_context_cgroup.md)
        rooms.append(Room(left, f"the memory cgroup's limit ({format_bytes(cg.limit)}) less "
                                f"the {format_bytes(cg.limit - left)} it charges now"))
    return min(rooms, key=lambda r: r.bytes)


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, else psutil's figure (not Linux)."""
    if (available := meminfo().get("MemAvailable")) is not None:
        return available
    return int(psutil.virtual_memory().available)
