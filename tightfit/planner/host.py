"""The host side of a plan: how much pinned memory offloaded activations and optimizer pages
may take.

On CUDA both live in page-locked (pinned) host memory, so that copies run on a side stream
while the GPU computes. Pinned memory is taken out of what the operating system can page or
cache, and the process also needs RAM for itself, the data loader and the model load, so
the planner assumes only a fraction of the host's RAM can be pinned (``PINNED_FRACTION``;
``tightfit plan --pinned-fraction`` changes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.measure.sizes import format_bytes, parse_bytes

PINNED_FRACTION = 0.5


def machine_ram_bytes() -> int:
    """This machine's physical RAM (psutil)."""
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class HostLimit:
    """The host RAM a plan is checked against, and the part of it that may be pinned.

    Attributes:
        ram_bytes: Host RAM (``--host-ram``; this machine's by default).
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
        where = "this machine's RAM" if self.measured else "--host-ram"
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
