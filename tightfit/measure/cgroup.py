"""This process's memory cgroup: which one limits it, and where its charge can be read.

One definition of the cgroup-path logic, for the limit (:func:`limiting_cgroup`,
``probes.cgroup_memory_limit``) and for the probe that reads what the cgroup charges
(:class:`~tightfit.pressure.probes.CgroupProbe`). Both cgroup versions:

- v2 (unified): ``memory.max``, ``memory.current``; ``memory.stat`` is hierarchical.
- v1: ``memory.limit_in_bytes``, ``memory.usage_in_bytes``; ``memory.stat``'s ``total_*``
  lines are the hierarchical ones. "No limit" is a huge number, which counts as none.

A limit anywhere up the hierarchy applies, so the path is walked from the process's own
cgroup to the mount's root and the smallest limit wins; its cgroup's usage (all processes
under it) is what the kernel compares with that limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCgroup", "cgroup_room", "limiting_cgroup", "memory_cgroups", "stat_value"]


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup on this process's path.

    Attributes:
        path: Its folder under the cgroup mount.
        version: 1 or 2.
        limit: Its memory limit in bytes, ``None`` without one.
    """

    path: Path
    version: int
    limit: int | None

    @property
    def charge_file(self) -> Path:
        """The file holding the bytes the cgroup charges now (anonymous, page cache, kernel)."""
        return self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    @property
    def stat_file(self) -> Path:
        return self.path / "memory.stat"

    @property
    def file_keys(self) -> tuple[bytes, bytes]:
        """``memory.stat`` keys of the page cache on the LRU lists, hierarchical (v1: total_)."""
        prefix = b"" if self.version == 2 else b"total_"
        return prefix + b"inactive_file", prefix + b"active_file"


def memory_cgroups(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> list[MemoryCgroup]:
    """The memory cgroups on this process's path, from its own to the mount's root.

    Folders that are not there (a path above a container's namespaced root) are skipped.

    Args:
        proc_cgroup: The process's cgroup listing.
        root: Where the cgroup file systems are mounted (v1's memory controller under
            ``root/memory``; v2 at ``root``, or ``root/unified`` beside v1).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[MemoryCgroup] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            version, base, name = 2, root, "memory.max"
            if not (base / "cgroup.controllers").exists():
                base = root / "unified"  # hybrid hierarchy: v2 mounted beside v1
        elif "memory" in controllers.split(","):
            version, base, name = 1, root / "memory", "memory.limit_in_bytes"
        else:
            continue
        path = base / rel.lstrip("/")
        while True:  # from the leaf to the root: a limit anywhere up applies
            if (path / name).exists():
                found.append(MemoryCgroup(path, version, _read_limit(path / name)))
            if path == base or path.parent == path:
                break
            path = path.parent
    return found


def limiting_cgroup(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> MemoryCgroup | None:
    """The memory cgroup with the smallest limit on this process's path, or ``None``.

    See :func:`memory_cgroups` for the arguments.
    """
    limited = [c for c in memory_cgroups(proc_cgroup, root) if c.limit is not None]
    return min(limited, key=lambda c: c.limit or 0) if limited else None


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:  # unreadable
        return None
    if not text or text == "max" or int(text) >= 2**60:
        return None
    return int(text)


def stat_value(stat: bytes, key: bytes) -> int:
    """The value of ``key`` in a ``memory.stat`` text (0 when the kernel does not list it)."""
    at = stat.find(b"\n" + key + b" ")
    if at < 0:
        if not stat.startswith(key + b" "):
            return 0
        at = -1
    start = at + len(key) + 2
    end = stat.find(b"\n", start)
    return int(stat[start:] if end < 0 else stat[start:end])


def cgroup_room(cgroup: MemoryCgroup | None = None) -> int | None:
    """Bytes the limiting memory cgroup still lets its processes take, or ``None`` without one.

    ``limit - (charge - page cache on the LRU lists)``: the page cache is left out of the
    use, as :class:`~tightfit.pressure.probes.CgroupProbe` does, because the kernel reclaims it
    before it kills at the limit. Pinned (page-locked) memory is anonymous memory the kernel can
    neither reclaim nor swap, so this is the most a process may still pin.

    Args:
        cgroup: The cgroup to read; ``None`` finds :func:`limiting_cgroup`.
    """
    cgroup = cgroup if cgroup is not None else limiting_cgroup()
    if cgroup is None or cgroup.limit is None:
        return None
    try:
        charge = int(cgroup.charge_file.read_text())
        stat = cgroup.stat_file.read_bytes()
    except (OSError, ValueError):
        return None
    cache = sum(stat_value(stat, k) for k in cgroup.file_keys)
    return max(0, cgroup.limit - (charge - cache))
