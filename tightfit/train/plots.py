"""The run's pictures: the loss curve, the memory timeline and, under torchrun, memory per rank.

The timeline shows, per step, the optimizer state on the device tier against its budget,
the activation peak of the step (where it was measured), and paging traffic.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(history: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Training loss per step and, where the run evaluated, the eval loss beside it (PNG)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1.2,
            label="training loss")
    evals = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals), "o-", ms=4, lw=1.2, color="#d62728", label="eval loss")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("tightfit train: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_timeline(
    history: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    events: Sequence[Any] = (),
) -> Path:
    """Device-tier occupancy vs budget, activation peaks and paging traffic per step (PNG).

    Args:
        history: Per-step records with ``step``, ``device_bytes``, ``device_budget``,
            ``activation_peak`` (may be missing), ``paged_in``, ``paged_out``.
        path: Where to write the PNG.
        events: Paging events (objects or dicts with ``time``, ``reason``, ``bytes``) drawn
            as ticks against the step they fall in, when the optimizer reports them.
    """
    plt = _plt()
    steps = [h["step"] for h in history]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax.plot(steps, [h.get("device_bytes", 0) / MiB for h in history],
            label="optimizer state on device tier", color="#2b7bba")
    budgets = [h.get("device_budget") for h in history]
    if any(b is not None for b in budgets):
        ax.plot(steps, [(b or 0) / MiB for b in budgets], "--", color="#d62728",
                label="device budget")
    ax.set_ylabel("optimizer state on device, MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("tightfit train: memory timeline")
    handles, labels = ax.get_legend_handles_labels()
    act = [(h["step"], h["activation_peak"] / MiB) for h in history
           if h.get("activation_peak") is not None]
    if act:  # its own axis: activations are often 10-100x the paged state
        ax_act = ax.twinx()
        sc = ax_act.scatter(*zip(*act), s=16, color="#ff7f0e", zorder=3)
        ax_act.set_ylabel("activation peak (measured), MiB", color="#ff7f0e")
        ax_act.set_ylim(bottom=0, top=max(v for _, v in act) * 1.15)
        handles.append(sc)
        labels.append("activation peak of the step (right axis)")
    ax.legend(handles, labels, fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    ax2.bar(steps, [h.get("paged_in", 0) / MiB for h in history], color="#2ca02c",
            label="paged in")
    ax2.bar(steps, [-h.get("paged_out", 0) / MiB for h in history], color="#9467bd",
            label="paged out")
    times = [h.get("time") for h in history]
    if events and all(t is not None for t in times):
        for ev in events:
            t = ev.get("time") if isinstance(ev, dict) else getattr(ev, "time", None)
            if t is None:
                continue
            step = next((s for s, ts in zip(steps, times) if ts >= t), steps[-1] if steps else 0)
            ax2.axvline(step, color="#7f7f7f", alpha=0.15, lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("paging MiB / step")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


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
