"""The host side of a plan: how much pinned memory offloaded activations and optimizer pages
may take.

On CUDA both live in page-locked (pinned) host memory, so that copies run on a side stream
while the GPU computes. Pinned memory is taken out of what the operating system can page or
cache, and the process also needs RAM for itself, the data loader and the model load, so
the planner assumes only a fraction of the host's RAM can be pinned (``PINNED_FRACTION``;
``tightfit plan --pinned-fraction`` changes it). The RAM measured on this machine is capped by
the memory cgroup's limit (a container may use less than the node has).

The host bytes a plan counts are the bytes tightfit pins: it pins through
:mod:`tightfit.tiers.pinned`, exactly the bytes asked to the page (:func:`pinned_host_bytes`),
where torch's own pinned allocator would round each buffer up to a power of two
(:func:`torch_pinned_host_bytes`: the offload pool's one chunk of 14.5 GiB would pin 16 GiB,
17 GiB would pin 32 GiB). ``benchmarks/pinned.py`` puts the three side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.measure.cgroup import limiting_cgroup
from tightfit.measure.sizes import format_bytes, parse_bytes
from tightfit.tiers.pinned import pinned_size, torch_pinned_size

PINNED_FRACTION = 0.5


def machine_ram_bytes() -> int:
    """This machine's physical RAM (psutil), within the memory cgroup's limit if lower."""
    import psutil

    ram = int(psutil.virtual_memory().total)
    cg = limiting_cgroup()
    return min(ram, cg.limit) if cg is not None and cg.limit is not None else ram


def pinned_host_bytes(sizes: list[int]) -> int:
    """Bytes tightfit pins for buffers of ``sizes`` bytes: whole pages each, no rounding to
    a power of two (:func:`tightfit.tiers.pinned.pinned_size`)."""
    return sum(pinned_size(n) for n in sizes if n > 0)


def torch_pinned_host_bytes(sizes: list[int]) -> int:
    """Bytes torch's caching host allocator pins for the same buffers with its defaults: each
    rounded up to a power of two (what tightfit pinned before ``tightfit.tiers.pinned``)."""
    return sum(torch_pinned_size(n) for n in sizes if n > 0)


@dataclass(frozen=True)
class HostLimit:
    """The host RAM a plan is checked against, and the part of it that may be pinned.

    Attributes:
        ram_bytes: Host RAM (``--host-ram``; this machine's by default, within its memory
            cgroup's limit).
        pinned_fraction: Part of it that offloaded activations and the paged optimizer's
            host pages may take.
        measured: ``ram_bytes`` was read from this machine, not given.
    """

    ram_bytes: int
    pinned_fraction: float = PINNED_FRACTION
    measured: bool = False

    @property
    def budget(self) -> int:
        """Bytes the step may pin on the host."""
        return int(self.ram_bytes * self.pinned_fraction)

    def describe(self) -> str:
        where = "this machine's RAM or its cgroup's limit" if self.measured else "--host-ram"
        return (f"host: offloaded activations + optimizer pages must fit in "
                f"{format_bytes(self.budget)} of pinned memory ({100 * self.pinned_fraction:g}% "
                f"of {format_bytes(self.ram_bytes)}, {where})")


def host_limit(host_ram: str | int | None = None,
               pinned_fraction: float = PINNED_FRACTION) -> HostLimit:
    """The :class:`HostLimit` of ``host_ram`` (a size; ``None``: this machine's RAM).

    Raises:
        ValueError: A malformed size, or a fraction outside (0, 1].
    """
    if isinstance(pinned_fraction, bool) or not 0.0 < float(pinned_fraction) <= 1.0:
        raise ValueError(f"pinned_fraction must be in (0, 1], got {pinned_fraction!r}; e.g. 0.5 "
                         "lets offloaded activations and optimizer pages pin half the RAM.")
    if host_ram is None:
        return HostLimit(machine_ram_bytes(), float(pinned_fraction), measured=True)
    ram = parse_bytes(host_ram, what="host_ram")
    if ram < 2**20:
        raise ValueError(f"host_ram: {host_ram!r} is {ram} bytes, too small to be a host; a bare "
                         "number is bytes, so write the unit, e.g. '64GiB'.")
    return HostLimit(ram, float(pinned_fraction))
