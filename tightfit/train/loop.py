"""The training loop behind ``tightfit train``: set up, run the steps, finish.

:func:`train` is three calls: :func:`tightfit.train.setup.setup` checks everything and builds
the run (nothing is written before every check passed), :func:`run_steps` trains, evaluates
every ``--eval-every`` steps and saves the resume state every ``--save-every`` steps,
and :func:`finish` measures the report, draws the plots and publishes the adapter.
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
from tightfit.train.data import MicroBatch
from tightfit.train.eval import evaluate
from tightfit.train.options import RunConfig, TrainOptions
from tightfit.train.plots import plot_loss, plot_ranks, plot_timeline
from tightfit.train.schedule import lr_at
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
    """Train from ``run.start`` to ``--steps``, evaluating and saving the resume state on schedule.

    Raises:
        FloatingPointError: the loss is not finite.
    """
    t, model, optimizer = run.cfg.train, run.model, run.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    bar = _progress(run.start, t.steps, run.progress)
    prev = _opt_stats(optimizer)
    model.train()
    for step in range(run.start, t.steps):
        micros = run.data.train.step(step)  # a function of (seed, step)
        lr = lr_at(step, lr=run.cfg.optimizer.lr, schedule=t.lr_schedule,
                   warmup=t.warmup_steps, total=t.steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        tic = time.perf_counter()
        tracked = t.track_every > 0 and step % t.track_every == 0
        tracker = MemoryTracker(run.device) if tracked else None
        with tracker if tracker is not None else contextlib.nullcontext():
            loss = _forward_backward(run, micros)
        if t.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - tic

        stats = _opt_stats(optimizer)
        rec = _record(run, step, loss, micros, dt, tracker, stats, prev)
        prev = stats
        if run.data.eval is not None and (step + 1 == t.steps or (
                t.eval_every and (step + 1) % t.eval_every == 0)):
            rec.update(evaluate(run))
        run.history.append(rec)
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step + 1}; lower --lr.")
        _update_bar(bar, rec)
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
            run.last_saved = run.job.save_state(run.out, step + 1, model, optimizer, run.history)
    if bar is not None:
        bar.close()


def _forward_backward(run: Run, micros: list[MicroBatch]) -> torch.Tensor:
    """Forward and backward over a step's micro-batches; the step's loss (this rank's share).

    Each micro-batch's loss is its sum over target tokens divided by the step's target count
    (over all micro-batches and ranks, divided by the ranks because DDP and FSDP2 average
    gradients): the summed gradients are those of the mean loss over the whole step, equal to
    one batch ``--grad-accum`` times larger.
    """
    world = run.job.info.world_size if run.job.distributed else 1
    items = max(1, sum(m.targets for m in micros)) / world  # every rank sees the global rows
    total = torch.zeros((), device=run.device)
    for micro in micros:
        inputs = example_on(run.job.rows(micro.inputs), run.device)
        loss = run.runner(**inputs, num_items_in_batch=items).loss
        loss.backward()
        total = total + loss.detach()
    return total


def _record(
    run: Run,
    step: int,
    loss: torch.Tensor,
    micros: list[MicroBatch],
    seconds: float,
    tracker: MemoryTracker | None,
    stats: dict[str, Any],
    prev: dict[str, Any],
) -> dict[str, Any]:
    """One step's history record (under torchrun: the global loss and every rank's figures)."""
    tokens = sum(m.tokens for m in micros)
    rec = {
        "step": step + 1,
        "loss": run.job.mean(float(loss.item())),
        "lr": run.optimizer.param_groups[0]["lr"],
        "seconds": seconds,
        "tokens": tokens,  # the examples' tokens, all micro-batches and ranks
        "slots": sum(m.slots for m in micros),  # what was computed, padding included
        "targets": sum(m.targets for m in micros),  # tokens trained
        "tokens_per_s": tokens / seconds,
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
        **_data_meta(run),
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
    run.data.close()
    job.close()
    return TrainResult(out, history, report, files, list(run.info.notes))


def _data_meta(run: Run) -> dict[str, Any]:
    """What was trained on, the trained tokens, how full the batches were, the eval losses."""
    h = run.history
    tokens, slots = sum(x.get("tokens", 0) for x in h), sum(x.get("slots", 0) for x in h)
    evals = [{k: x[k] for k in ("step", "eval_loss", "eval_perplexity", "eval_tokens")}
             for x in h if x.get("eval_loss") is not None]
    return {
        "data": run.data.summary,
        "trained_tokens": sum(x.get("targets", 0) for x in h),
        # padding (bucket) or packing (pack) efficiency: the examples' share of what was computed
        "batch_efficiency": {"batching": run.cfg.data.batching, "tokens": tokens, "slots": slots,
                             "efficiency": tokens / slots if slots else None},
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_perplexity": evals[-1]["eval_perplexity"] if evals else None,
        "eval": evals,
    }


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
    shown = {"loss": f"{rec['loss']:.3f}", "tok_s": f"{rec['tokens_per_s']:.0f}", "dev": occ}
    if rec.get("eval_loss") is not None:
        bar.last_eval = f"{rec['eval_loss']:.3f}"
    if getattr(bar, "last_eval", None) is not None:
        shown["eval"] = bar.last_eval
    bar.set_postfix(shown, refresh=False)
    bar.update(1)
