"""The training loop behind ``tightfit train``: set up, run the steps, finish.

:func:`train` is three calls: :func:`tightfit.train.setup.setup` checks everything and builds
the run (nothing is written before every check passed), :func:`run_steps` trains and saves
the resume state every ``--save-every`` steps, and :func:`finish` measures the report, draws
the plots and publishes the adapter.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tightfit.measure.tracker import MemoryTracker
from tightfit.report.report import MemoryReport, measure_report
from tightfit.train import resume
from tightfit.train.options import RunConfig, TrainOptions
from tightfit.train.plots import plot_loss, plot_ranks, plot_timeline
from tightfit.train.setup import Run, setup

__all__ = ["RunConfig", "TrainOptions", "TrainResult", "finish", "run_steps", "train"]


@dataclass
class TrainResult:
    """What a run produced."""

    out: Path
    history: list[dict[str, Any]]
    report: MemoryReport
    files: dict[str, Path]
    notes: list[str]


def train(
    cfg: RunConfig,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Run ``tightfit train``.

    Args:
        cfg: The run's options.
        progress: Show a progress bar (loss, tokens/s, device-tier occupancy).
        log: Where to print messages.

    Returns:
        The output folder, the per-step history, the memory report and the files written.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad input, before training starts.
    """
    run = setup(cfg, progress=progress, log=log)
    run_steps(run)
    return finish(run)


def run_steps(run: Run) -> None:
    """Train from ``run.start`` to ``--steps``, saving the resume state on schedule.

    Raises:
        FloatingPointError: the loss is not finite.
    """
    t, model, optimizer = run.cfg.train, run.model, run.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    bar = _progress(run.start, t.steps, run.progress)
    prev = _opt_stats(optimizer)
    model.train()
    for step in range(run.start, t.steps):
        batch = run.tokens.batch(step, t.batch_size, t.seq_len, t.seed)  # a function of step
        batch = example_on(run.job.rows(batch), run.device)
        for g in optimizer.param_groups:
            g["lr"] = _lr_at(step, run.cfg.optimizer.lr, t.warmup_steps)
        tic = time.perf_counter()
        tracked = t.track_every > 0 and step % t.track_every == 0
        tracker = MemoryTracker(run.device) if tracked else None
        with tracker if tracker is not None else contextlib.nullcontext():
            loss = run.runner(**batch).loss
            loss.backward()
        if t.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - tic

        stats = _opt_stats(optimizer)
        rec = _record(run, step, loss, dt, tracker, stats, prev)
        prev = stats
        run.history.append(rec)
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step + 1}; lower --lr.")
        _update_bar(bar, rec)
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
            run.last_saved = run.job.save_state(run.out, step + 1, model, optimizer, run.history)
    if bar is not None:
        bar.close()


def _record(
    run: Run,
    step: int,
    loss: torch.Tensor,
    seconds: float,
    tracker: MemoryTracker | None,
    stats: dict[str, Any],
    prev: dict[str, Any],
) -> dict[str, Any]:
    """One step's history record (under torchrun: the mean loss and every rank's figures)."""
    t = run.cfg.train
    rec = {
        "step": step + 1,
        "loss": run.job.mean(float(loss.item())),
        "lr": run.optimizer.param_groups[0]["lr"],
        "seconds": seconds,
        "tokens_per_s": t.batch_size * t.seq_len / seconds,
        "time": time.monotonic(),  # the clock paging events use
        "device_bytes": int(stats.get("device_bytes", 0)),
        "device_budget": stats.get("device_budget"),
        "activation_peak": tracker.peak_bytes if tracker is not None else None,
        "paged_in": int(stats.get("bytes_paged_in", 0)) - int(prev.get("bytes_paged_in", 0)),
        "paged_out": int(stats.get("bytes_paged_out", 0)) - int(prev.get("bytes_paged_out", 0)),
    }
    rec.update(run.job.rank_figures(rec))
    return rec


def finish(run: Run) -> TrainResult:
    """Measure the report, write it, the plots and the adapter; release the optimizer and job."""
    t, job, optimizer, history, out = run.cfg.train, run.job, run.optimizer, run.history, run.out
    report = measure_report(run.model, example_on(job.rows(run.example), run.device),
                            optimizer=optimizer, base_numel=run.info.base_numel)
    report.meta.update(job.report_meta(optimizer))
    report.meta.update({
        "steps": t.steps,
        "tokens_per_s_median": _median([h["tokens_per_s"] for h in history]),
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
    })
    files = report.save(out) if job.is_main else {}
    events = _paging_events(optimizer)
    if job.is_main:
        files["loss_png"] = plot_loss(history, out / "loss_curve.png")
        files["timeline_png"] = plot_timeline(history, out / "memory_timeline.png", events)
        if job.distributed:
            files["ranks_png"] = plot_ranks(history, out / "memory_ranks.png")
        if run.last_saved is not None:
            files["adapter"] = resume.publish_adapter(out, run.last_saved)
            files["saved_state"] = run.last_saved
    close = getattr(optimizer, "close", None)
    if callable(close):
        close()
    job.close()
    return TrainResult(out, history, report, files, list(run.info.notes))


def _lr_at(step: int, lr: float, warmup: int) -> float:
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def _opt_stats(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    stats = getattr(optimizer, "memory_stats", None)
    if callable(stats):
        return dict(stats())
    total = sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"device_bytes": total, "device_budget": None, "bytes_paged_in": 0,
            "bytes_paged_out": 0}


def example_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _paging_events(optimizer: torch.optim.Optimizer) -> list[Any]:
    fn = getattr(optimizer, "paging_events", None)
    return list(fn()) if callable(fn) else []


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def _progress(start: int, total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _update_bar(bar: Any, rec: dict[str, Any]) -> None:
    if bar is None:
        return
    budget = rec.get("device_budget")
    dev = rec["device_bytes"]
    occ = f"{dev / budget:.0%}" if budget else f"{dev / 2**20:.1f}MiB"
    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", dev=occ,
                    refresh=False)
    bar.update(1)
