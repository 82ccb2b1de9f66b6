"""The run's pictures: the loss curve, the memory timeline and, under torchrun, memory per rank.

The loss curve shows the training loss, the eval loss where the run evaluated and the
learning rate on a second axis (after a resume with more ``--steps`` a decaying schedule
starts again from higher up), with a vertical line at each step the run was resumed at
(:func:`loss_curves` is what it draws).

The timeline shows, per step, the memory in use (the total at the end of the step, its peak,
the target and the measured activation peak), the optimizer state on the device tier, and the
bytes paged in and out (both drawn upward, each labelled); a panel with nothing to show (no
paging, a run without a paged optimizer) is left out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tightfit.train.memory import resumed_at

MiB = 1 << 20


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curves(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the loss plot draws: ``loss``, ``eval`` and ``lr`` as ``(steps, values)`` (empty
    where the history has none) and ``resumed_at``, the steps a resume started from."""
    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    return {"loss": series("loss"), "eval": series("eval_loss"), "lr": series("lr"),
            "resumed_at": resumed_at(list(history))}


def plot_loss(history: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Training loss per step, the eval loss where the run evaluated, the learning rate (a
    second axis) and the steps resumed at (PNG)."""
    plt = _plt()
    curves = loss_curves(history)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*curves["loss"], lw=1.2, label="training loss")
    if curves["eval"][0]:
        ax.plot(*curves["eval"], "o-", ms=4, lw=1.2, color="#d62728", label="eval loss")
    for i, step in enumerate(curves["resumed_at"]):
        steps = ", ".join(map(str, curves["resumed_at"]))
        ax.axvline(step, color="#7f7f7f", ls="--", lw=1,
                   label=None if i else f"resumed at step {steps}")
    handles, labels = ax.get_legend_handles_labels()
    top = ax
    if curves["lr"][0]:
        top = ax.twinx()  # drawn above the loss axes: the legend goes on it
        top.plot(*curves["lr"], lw=1, color="#2ca02c", alpha=0.8, label="learning rate")
        top.set_ylabel("learning rate", color="#2ca02c")
        top.tick_params(axis="y", colors="#2ca02c")
        top.yaxis.set_major_formatter(lambda v, _: f"{v:.1e}" if v else "0")
        top.set_ylim(bottom=0)
        more = top.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if len(handles) > 1:
        top.legend(handles, labels, fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("tightfit train: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def timeline_panels(history: Sequence[dict[str, Any]], events: Sequence[Any] = ()) -> list[str]:
    """The panels the memory timeline draws: only those with something to show.

    ``"memory"`` (the step's total, its peak, the target), ``"state"`` (optimizer state on
    the device) and ``"paging"`` (bytes moved per step), in that order.
    """
    panels = []
    if any(h.get("mem_total") is not None or h.get("activation_peak") is not None
           for h in history):
        panels.append("memory")
    if any(h.get("device_bytes") for h in history):
        panels.append("state")
    if events or any(h.get("paged_in") or h.get("paged_out") for h in history):
        panels.append("paging")
    return panels


def plot_timeline(
    history: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    events: Sequence[Any] = (),
) -> Path:
    """The run's memory per step: total and peak vs the target, the optimizer state on the
    device, and paging traffic (PNG); panels with nothing to show are left out.

    Args:
        history: Per-step records (``step``, ``mem_total``, ``mem_peak``, ``host_rss_peak``,
            ``target_bytes``, ``activation_peak``, ``device_bytes``, ``device_budget``,
            ``paged_in``, ``paged_out``, ``time``); missing keys are skipped.
        path: Where to write the PNG.
        events: Paging events (objects or dicts with ``time`` and ``kind``), drawn as ticks
            at the step they fall in.
    """
    plt = _plt()
    panels = timeline_panels(history, events) or ["memory"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 + 2.2 * len(panels)), sharex=True,
                             squeeze=False)
    draw = {"memory": _memory_panel, "state": _state_panel, "paging": _paging_panel}
    for ax, name in zip(axes[:, 0], panels):
        draw[name](ax, history, events)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[0, 0].set_title("tightfit train: memory timeline")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key] / MiB) for h in history if h.get(key) is not None]
    return ([s for s, _ in pts], [v for _, v in pts]) if pts else ([], [])


def _memory_panel(ax: Any, history: Sequence[dict[str, Any]], events: Sequence[Any]) -> None:
    cuda = any(h.get("mem_peak") is not None for h in history)
    total = "allocated at the end of the step" if cuda else "process RSS at the end of the step"
    for key, label, style in (
        ("mem_total", total, {"color": "#2b7bba"}),
        ("mem_peak" if cuda else "host_rss_peak",
         "allocator high-water mark so far" if cuda else "RSS high-water mark so far",
         {"color": "#1f77b4", "ls": ":"}),
        ("target_bytes", "target (pages leave the device above it)",
         {"color": "#d62728", "ls": "--"}),
    ):
        xs, ys = _series(history, key)
        if xs:
            ax.plot(xs, ys, label=label, **style)
    xs, ys = _series(history, "activation_peak")
    if xs:
        ax.scatter(xs, ys, s=16, color="#ff7f0e", zorder=3,
                   label="activation peak of the step (measured, above what was live)")
    for i, step in enumerate(resumed_at(list(history))):
        ax.axvline(step, color="#7f7f7f", ls="--", lw=1,
                   label=None if i else "resumed (a new process: its marks start again)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)


def _state_panel(ax: Any, history: Sequence[dict[str, Any]], events: Sequence[Any]) -> None:
    steps = [h["step"] for h in history]
    state = [h.get("device_bytes", 0) / MiB for h in history]
    budgets = [h.get("device_budget") for h in history]
    if all(b is not None and b / MiB == s for b, s in zip(budgets, state)):
        # one line, not two on top of each other: the state fills its budget at every step
        ax.plot(steps, state, color="#2b7bba",
                label=f"optimizer state on the device = --device-budget ({state[-1]:.2f} MiB)")
    else:
        ax.plot(steps, state, color="#2b7bba", label="optimizer state on the device")
        if any(b is not None for b in budgets):
            ax.plot(steps, [(b or 0) / MiB for b in budgets], "--", color="#7f7f7f",
                    label="device budget")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)


def _paging_panel(ax: Any, history: Sequence[dict[str, Any]], events: Sequence[Any]) -> None:
    steps = [h["step"] for h in history]
    ax.bar([s - 0.2 for s in steps], [h.get("paged_in", 0) / MiB for h in history], 0.4,
           color="#2ca02c", label="paged in (to the device)")
    ax.bar([s + 0.2 for s in steps], [h.get("paged_out", 0) / MiB for h in history], 0.4,
           color="#9467bd", label="paged out (off the device)")
    times = [h.get("time") for h in history]
    kinds = {"evict": "#9467bd", "restore": "#2ca02c", "oom": "#d62728"}
    if events and steps and all(t is not None for t in times):
        seen: set[str] = set()
        for ev in events:
            t = ev.get("time") if isinstance(ev, dict) else getattr(ev, "time", None)
            kind = ev.get("kind") if isinstance(ev, dict) else getattr(ev, "kind", None)
            if t is None or kind not in kinds:
                continue
            step = next((s for s, ts in zip(steps, times) if ts >= t), steps[-1])
            label = None if kind in seen else f"{kind} event"
            seen.add(kind)
            ax.axvline(step, color=kinds[kind], alpha=0.25, lw=0.8, label=label)
    ax.set_ylabel("MiB moved per step")
    ax.set_ylim(bottom=0)


def plot_ranks(history: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Optimizer state on each rank's device tier vs the per-rank budget, and paging per rank.

    Args:
        history: step records with ``step``, ``device_budget`` and ``ranks`` (one dict per
            rank with ``device_bytes``, ``paged_in``, ``paged_out``), as the loop writes them
            under torchrun; records of another rank count (a resumed run) are left out.
        path: where to write the PNG.
    """
    plt = _plt()
    # a run resumed from another layout (one process, other ranks) has steps without ranks,
    # or other counts: the steps of this launch's layout, the newest
    world = len(history[-1].get("ranks") or []) if history else 0
    history = [h for h in history if len(h.get("ranks") or []) == world]
    steps = [h["step"] for h in history]
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
