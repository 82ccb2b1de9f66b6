"""The run's part of the report: the step's memory, what paging did, and the plan's prediction.

:func:`describe_run` fills a measured :class:`~tightfit.report.document.MemoryReport` with
what only the training run knows: each step's total and peak memory (device and host, as
:class:`~tightfit.train.memory.StepMemory` recorded them), the pager's moves, bytes, time on
pressure and out-of-memory retries, and every piece beside what ``tightfit plan`` predicted
for the same setup (:mod:`tightfit.train.predicted`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tightfit.report.document import MemoryReport
from tightfit.train.predicted import compare, planned_estimate

if TYPE_CHECKING:
    from tightfit.train.run_setup import Run

_PAGING_KEYS = ("target_bytes", "evictions", "restores", "evicted_bytes", "restored_bytes",
                "bytes_paged_in", "bytes_paged_out", "pressure_seconds", "stall_seconds",
                "oom_recoveries", "watch_reads", "watch_seconds", "over_target_reads")


def describe_run(report: MemoryReport, run: Run, stats: dict[str, Any]) -> None:
    """Fill ``report.step``, ``report.paging`` and ``report.predicted`` from the run.

    Args:
        report: The report measured at the end of the run.
        run: The run.
        stats: The optimizer's ``memory_stats()`` at the end of training (before the
            report's own passes).
    """
    history = [h for h in run.history if "mem_total" in h]  # this version's records
    report.step = step_memory(report, history, run.device.type)
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


def paging_summary(stats: dict[str, Any], run: Run) -> dict[str, Any]:
    """What the pager did over the run, with the out-of-memory retries of the loop."""
    if not callable(getattr(run.optimizer, "memory_stats", None)):
        return {}
    out: dict[str, Any] = {k: stats[k] for k in _PAGING_KEYS if k in stats}
    target = run.cfg.optimizer.target
    out["target_option"] = f"--target {'none' if target is None else target}"
    out["oom_retries"] = run.oom_retries
    step_seconds = sum(h.get("seconds", 0.0) for h in run.history)
    pressure = float(stats.get("pressure_seconds", 0.0))
    out["pressure_share"] = pressure / step_seconds if step_seconds else None
    return out
