"""Per-rank memory plot of a distributed ``tightfit train`` run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tightfit.train.plots import MiB, _plt


def plot_ranks(history: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Optimizer state on each rank's device tier vs the per-rank budget, and paging per rank.

    Args:
        history: step records with ``step``, ``device_budget`` and ``ranks`` (one dict per
            rank with ``device_bytes``, ``paged_in``, ``paged_out``), as the loop writes them
            under torchrun.
        path: where to write the PNG.
    """
    plt = _plt()
    steps = [h["step"] for h in history]
    world = len(history[0]["ranks"]) if history else 0
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in range(world):
        ax.plot(steps, [(h["ranks"][r]["device_bytes"] or 0) / MiB for h in history],
                label=f"rank {r}: state on device tier")  # fmt: skip
        ax2.plot(steps, [(h["ranks"][r]["paged_in"] or 0) / MiB for h in history],
                 label=f"rank {r}: paged in")  # fmt: skip
    budgets = [h.get("device_budget") for h in history]
    if any(b is not None for b in budgets):
        ax.plot(steps, [(b or 0) / MiB for b in budgets], "--", color="#d62728",
                label="device budget (per rank)")  # fmt: skip
    ax.set_ylabel("MiB")
    ax.set_title(f"tightfit train: memory per rank ({world} ranks)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("paged in, MiB / step")
    for a in (ax, ax2):
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
