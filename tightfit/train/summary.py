"""The run's part of the report: the step's memory, what paging did, and the plan's prediction.

:func:`describe_run` fills a measured :class:`~tightfit.report.document.MemoryReport` with
what only the training run knows: each step's total and peak memory (device and host, as
:class:`~tightfit.train.memory.StepMemory` recorded them), the pager's moves, bytes, time on
pressure and out-of-memory retries, the run's memory over all its steps (those before a
resume included: :func:`run_memory`), and every piece beside what ``tightfit plan`` predicted
for the same setup (:mod:`tightfit.train.predicted`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tightfit.report.document import MemoryReport
from tightfit.train.memory import resumed_at, target_flag
from tightfit.train.predicted import compare, planned_estimate

if TYPE_CHECKING:
    from tightfit.train.run_setup import Run

_PAGING_KEYS = ("target_bytes", "evictions", "restores", "evicted_bytes", "restored_bytes",
                "evict_events", "restore_events", "bytes_paged_in", "bytes_paged_out",
                "pressure_seconds", "stall_seconds", "oom_recoveries", "watch_reads",
                "watch_seconds", "over_target_reads")
# counts a paged optimizer without a target has not got: nothing moved under pressure
_ZERO_WITHOUT_TARGET = {"evictions": 0, "restores": 0, "evicted_bytes": 0, "restored_bytes": 0,
                        "pressure_seconds": 0.0}


def describe_run(report: MemoryReport, run: Run, stats: dict[str, Any]) -> None:
    """Fill ``report.step``, ``report.run``, ``report.paging`` and ``report.predicted``.

    Args:
        report: The report measured at the end of the run.
        run: The run.
        stats: The optimizer's ``memory_stats()`` at the end of training (before the
            report's own passes).
    """
    history = [h for h in run.history if "mem_total" in h]  # this version's records
    report.step = step_memory(report, history, run.device.type)
    report.run = run_memory(history, run.device.type)
    report.paging = paging_summary(stats, run)
    est, why = planned_estimate(run)
    if est is None:
        report.meta["predicted"] = f"not compared: {why}"
        return
    report.predicted = compare(report, est, report.step.get("device", {}).get("peak_bytes"))


def step_memory(report: MemoryReport, history: list[dict[str, Any]], device: str) -> dict:
    """The step's memory: device peak and end-of-step bytes, host RSS, the pieces counted."""
    # weights, constants, frozen rest, LoRA params and the activation peak (which holds the
    # gradients made in backward), with the optimizer state on the device
    counted = sum(report.piece(n).with_bytes for n in ("base weights", "quantization constants",
                                                       "activations"))
    counted += int(report.meta.get("frozen_other_bytes", 0))
    counted += int(report.piece("trainable params + grads").detail.get("param_bytes", 0))
    opt = next((p for p in report.pieces if p.name == "optimizer state"), None)
    if opt is not None:
        counted += min(opt.with_bytes, int(opt.detail.get("device", opt.with_bytes)))
    last = history[-1] if history else {}
    peaks = [h["mem_peak"] for h in history if h.get("mem_peak") is not None]
    cuda = device == "cuda"
    return {
        "device": {
            "peak_bytes": max(peaks) if peaks else None,
            "end_of_step_bytes": last.get("mem_total") if cuda else None,
            "counted_bytes": counted,
        },
        "host": {
            "rss_bytes": last.get("host_rss"),
            "rss_peak_bytes": max((h.get("host_rss_peak") or 0 for h in history), default=None),
        },
        "how": ("CUDA allocator: max_memory_allocated (high-water mark since the start, the "
                "planner's profile of the longest batch included), memory_allocated at the end "
                "of the step; host: process RSS" if cuda else
                "CPU: device and host are one place: process RSS at the end of the step and its "
                "high-water mark since the start (the planner's profile of the longest batch "
                "included); pieces counted from the tensors, the activation peak measured"),
    }


def run_memory(history: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """The run's memory over every step it recorded, in each process it ran in.

    ``total_bytes`` is the largest end-of-step total (CUDA: ``memory_allocated``; CPU: the
    process RSS) and ``peak_bytes`` the highest high-water mark (CUDA:
    ``max_memory_allocated``; CPU: the RSS high-water mark), each the largest over the
    processes of the run (each resume starts a new process, and its marks start again).
    ``resumed_at`` lists the steps the run was resumed at (the saved step each process
    started from); the bytes paged and the steps retried are summed over all steps.
    """
    if not history:
        return {}
    cuda = device == "cuda"
    peaks = [h.get("mem_peak" if cuda else "host_rss_peak") for h in history]
    return {
        "first_step": history[0]["step"],
        "last_step": history[-1]["step"],
        "steps": len(history),
        "resumed_at": resumed_at(history),
        "total_bytes": max(h["mem_total"] for h in history),
        "peak_bytes": max((p for p in peaks if p is not None), default=None),
        "measured_as": ("CUDA allocator: memory_allocated at the end of a step, "
                        "max_memory_allocated" if cuda else
                        "CPU: process RSS at the end of a step, its high-water mark"),
        "bytes_paged_in": sum(h.get("paged_in", 0) for h in history),
        "bytes_paged_out": sum(h.get("paged_out", 0) for h in history),
        "oom_retries": sum(bool(h.get("oom_retry")) for h in history),
    }


def paging_summary(stats: dict[str, Any], run: Run) -> dict[str, Any]:
    """What the pager did in this process (since ``since_step``: 0, or the step resumed at),
    with the out-of-memory retries of the loop."""
    if not callable(getattr(run.optimizer, "memory_stats", None)):
        return {}
    out: dict[str, Any] = dict(_ZERO_WITHOUT_TARGET)
    out.update({k: stats[k] for k in _PAGING_KEYS if k in stats})
    out["since_step"] = run.start
    target = run.cfg.optimizer.target
    out["target_option"] = f"--target {'none' if target is None else target_flag(target)}"
    out["oom_retries"] = run.oom_retries
    step_seconds = sum(h.get("seconds", 0.0) for h in run.history)
    pressure = float(stats.get("pressure_seconds", 0.0))
    out["pressure_share"] = pressure / step_seconds if step_seconds else None
    return out
