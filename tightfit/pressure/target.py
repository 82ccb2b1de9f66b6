"""The target occupancy: what ``target`` options mean in bytes, and the default.

A target is the usage a device should stay under (:class:`~tightfit.pressure.occupancy.
OccupancyControl` keeps it, :class:`~tightfit.pressure.watch.PressureWatch` checks it between
blocks): a fraction of the probe's capacity, or bytes. ``"auto"`` (:func:`default_target`) is
a fraction where a capacity says how much memory there is, and off where none does.
"""

from __future__ import annotations

from tightfit.pressure.probes import Probe

__all__ = ["DEFAULT_CGROUP_TARGET", "DEFAULT_CUDA_TARGET", "default_target", "resolve_target"]

#: Default target on CUDA, as a fraction of the device's capacity.
DEFAULT_CUDA_TARGET = 0.9
#: Default target on the CPU under a memory cgroup, as a fraction of the cgroup's limit, read
#: against what the cgroup charges less its page cache (:class:`~tightfit.pressure.probes.
#: CgroupProbe`); the rest of the limit is room for the page cache a run keeps using (the
#: libraries' code, the spill file). Measured: benchmarks/results/spike_cli.md.
DEFAULT_CGROUP_TARGET = 0.9


def default_target(probe: Probe) -> float | None:
    """The target ``"auto"`` means for ``probe``'s device, or ``None`` where none can act.

    CUDA: :data:`DEFAULT_CUDA_TARGET` of the device. The CPU: :data:`DEFAULT_CGROUP_TARGET`
    of the capacity when the probe knows one (a :class:`~tightfit.pressure.probes.CgroupProbe`,
    the default under a memory cgroup with a limit); without one nothing says how much memory there is,
    so ``None`` (pass bytes to turn pressure handling on).
    """
    if probe.device.type == "cuda":
        return DEFAULT_CUDA_TARGET
    return DEFAULT_CGROUP_TARGET if probe.capacity_bytes() is not None else None


def resolve_target(target: float | int | None, probe: Probe) -> int:
    """Turn a ``target`` option into bytes.

    Args:
        target: A float in (0, 1] is a fraction of the probe's capacity; an int is bytes;
            ``None`` is 0.9 of the capacity on CUDA and an error elsewhere (on the CPU
            "capacity" is what the user says it is).
        probe: The probe whose capacity a fraction refers to.

    Returns:
        The target in bytes.

    Raises:
        TypeError: ``target`` is not a float, int or None.
        ValueError: the fraction is outside (0, 1], the bytes are not positive, or a fraction
            (or the default) was asked for and the probe's capacity is unknown.
    """
    if isinstance(target, bool) or not (target is None or isinstance(target, int | float)):
        raise TypeError(
            f"target must be a fraction of capacity (float in (0, 1]) or bytes (int), got "
            f"{target!r}; e.g. target=0.9 or target=6 * 2**30."
        )
    capacity = probe.capacity_bytes()
    if target is None:
        if probe.device.type != "cuda":
            raise ValueError(
                f"a target is required on {probe.device.type!r}: pass target=<bytes> (an int), "
                "e.g. target=8 * 2**30, or a probe with a known capacity and a fraction."
            )
        target = DEFAULT_CUDA_TARGET
    if isinstance(target, float):
        if not 0.0 < target <= 1.0:
            raise ValueError(
                f"a fractional target must be in (0, 1], got {target}; pass bytes as an int."
            )
        if capacity is None:
            raise ValueError(
                f"target={target} is a fraction of capacity, but {probe!r} does not know its "
                "capacity; pass target=<bytes> (an int) or give the probe a capacity."
            )
        return int(target * capacity)
    if target <= 0:
        raise ValueError(f"target in bytes must be positive, got {target}.")
    return int(target)
