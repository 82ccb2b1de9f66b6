"""The memory figures of a run: each step's total and peak, the optimizer's paging, pressure.

Per step, :class:`StepMemory` records what a person watching the machine would see:

* on CUDA, the allocator's bytes at the end of the step (``memory_allocated``) and its
  high-water mark so far (``max_memory_allocated``), plus the process's RSS on the host;
* on the CPU, where device and host are one place, the process's RSS at the end of the step
  (``/proc/self/statm``) and its high-water mark so far (``getrusage``);
* the count of steps this process has measured (``process_step``: 1 on the first step of a
  run and on the first step after each resume, where the high-water marks start again).

Nothing is reset here: the high-water marks are the process's, so a spike shows as a step
up of the line. ``MemoryTracker`` (``--track-every``) does reset the allocator's peak, so on
CUDA ``mem_peak`` is the largest ``max_memory_allocated`` any step has read: a reset cannot
lower it (a transient before a reset within a tracked step is in the tracker's figures),
and the first steps' mark includes what setting up the run needed (the checkpoint planner
profiles the longest batch without checkpointing).
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit.planner.train_args import size_arg
from tightfit.pressure.probes import RSSProbe
from tightfit.report.text import wrap

MiB = 1 << 20


class StepMemory:
    """Reads one step's memory figures (see the module docstring) on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rss = RSSProbe()
        self._steps = 0
        self._peak = 0  # the largest allocator peak read (MemoryTracker resets torch's)

    def end_step(self) -> dict[str, int | None]:
        """``mem_total``, ``mem_peak`` (CUDA only, so far; ``None`` on the CPU), ``host_rss``
        and ``host_rss_peak`` (so far) in bytes, as of now, and ``process_step``."""
        self._steps += 1
        rss = self._rss.used_bytes()
        if self.device.type == "cuda":
            total = torch.cuda.memory_allocated(self.device)
            self._peak = max(self._peak, int(torch.cuda.max_memory_allocated(self.device)))
            peak: int | None = self._peak
        else:
            total, peak = rss, None
        # the kernel updates its high-water mark lazily: it may trail the RSS just read
        return {"mem_total": int(total), "mem_peak": peak, "host_rss": rss,
                "host_rss_peak": max(rss, RSSProbe.process_peak_bytes()),
                "process_step": self._steps}


def resumed_at(history: list[dict[str, Any]]) -> list[int]:
    """The steps a run was resumed at (each the saved step a new process started from): one
    before each record that is the first of its process (``process_step`` 1) but not step 1."""
    return [h["step"] - 1 for h in history if h.get("process_step") == 1 and h["step"] > 1]


def optimizer_stats(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A paged optimizer's ``memory_stats()``; for any other its state bytes as resident."""
    stats = getattr(optimizer, "memory_stats", None)
    if callable(stats):
        return dict(stats())
    total = sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"device_bytes": total, "device_budget": None, "bytes_paged_in": 0,
            "bytes_paged_out": 0}


def target_flag(target: object) -> str:
    """``--target``'s value as typed back: bytes as a size (``6GiB``), else as it is."""
    return size_arg(target) if isinstance(target, int) and not isinstance(target, bool) \
        else str(target)


def pressure_note(optimizer: torch.optim.Optimizer, target_option: object) -> str:
    """Whether, and how, the optimizer keeps the device under a target (≤ 100 columns)."""
    return wrap(_pressure_text(optimizer, target_option))


def _pressure_text(optimizer: torch.optim.Optimizer, target_option: object) -> str:
    stats = optimizer_stats(optimizer)
    target = stats.get("target_bytes")
    if target is None:
        if not callable(getattr(optimizer, "memory_stats", None)):
            return "pressure: off (torch's AdamW has no pages to move; --optimizer paged_adamw)"
        if target_option is None:
            return "pressure: off (--target none)"
        return ("pressure: off (--target auto acts on CUDA, or on the CPU under a memory "
                "cgroup limit;\n  pass --target BYTES to keep this process's RSS under it)")
    watched = "watching the model's blocks" if "watch_reads" in stats else "not watching"
    how = "auto" if target_option == "auto" else f"--target {target_flag(target_option)}"
    return (f"pressure: target {target / MiB:,.1f} MiB ({how}); {watched}:\n  optimizer pages "
            "leave the device before a spike passes it and come back after")
