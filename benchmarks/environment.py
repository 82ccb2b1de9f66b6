"""The machine and versions header every benchmark writes into its results file.

Imported by the scripts beside it as ``from environment import ...`` (a script run as
``.venv/bin/python benchmarks/<name>.py`` has its own folder first on ``sys.path``).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

_PACKAGES = ("bitsandbytes", "transformers", "peft")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    """Versions of Python, torch, bitsandbytes, transformers and peft (in that order)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in _PACKAGES:
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - report whatever stops the import
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


def versions_text() -> str:
    """``"torch X, bitsandbytes Y, transformers Z, peft W"``."""
    return ", ".join(f"{k} {v}" for k, v in versions().items() if k != "python")


def load_text(load: tuple[float, float, float], digits: int = 2, sep: str = " / ") -> str:
    """A ``os.getloadavg()`` triple as ``"1.23 / 4.56 / 7.89"``."""
    return sep.join(f"{x:.{digits}f}" for x in load)


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs from (``"unknown"`` outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown"
