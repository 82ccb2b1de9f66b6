"""Byte sizes as people write them ("24GiB", "80 GB", "512MiB") and back.

Memory is bytes everywhere inside tightfit; this module is the one door through which a
human-written size comes in and a readable size goes out.
"""

from __future__ import annotations

import math
import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float, *, what: str = "size") -> int:
    """Parse a size such as ``"24GiB"``, ``"80GB"``, ``"1.5 TiB"`` or ``1073741824``.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024, as the SI/IEC standards say; a bare number is bytes.

    Args:
        text: The size, as a string or a number of bytes.
        what: What the size is for, used in error messages (e.g. ``"--gpu"``).

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        ValueError: For anything that is not a positive, finite size with a known unit.
    """
    if isinstance(text, bool):
        raise TypeError(f"{what}: expected a size like '24GiB', got the boolean {text!r}.")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    elif isinstance(text, str):
        m = _SIZE_RE.match(text)
        if m is None:
            raise ValueError(
                f"{what}: cannot read {text!r} as a size; write a number and a unit, "
                "e.g. '24GiB', '80GB' or '512MiB'."
            )
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(
                f"{what}: unknown unit {m.group(2)!r} in {text!r}; use one of "
                "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)."
            )
    else:
        raise TypeError(f"{what}: expected a size like '24GiB' or a number of bytes, got {text!r}.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: a size must be positive, got {text!r}; e.g. '24GiB'.")
    nbytes = int(value * _UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"{what}: {text!r} is less than one byte; e.g. '24GiB'.")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """Format bytes for people in binary units, about three digits (``"13.5 GiB"``)."""
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B" or value >= 100:
        return f"{sign}{value:.0f} {unit}"
    return f"{sign}{value:.{1 if value >= 10 else 2}f} {unit}"
