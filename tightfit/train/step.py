"""One training step: forward and backward (retried once after running out of memory), then
the update, held against Ctrl-C, and the step's record.

A step moves through two parts. Forward and backward change nothing that lasts (only the
gradients, which are cleared before a retry), so an out-of-memory error there is recoverable:
the optimizer's device pages are drained (:func:`tightfit.pressure.occupancy.recover_from_oom`),
what the failed attempt held is freed, the RNG is set back to the step's start (dropout draws
the same masks) and the step runs once more. The update, ``zero_grad`` and the step's record
run with Ctrl-C held (:func:`tightfit.integrity.interrupts.hold_interrupts`), so an interrupt
lands either before the update (the step did not happen) or after its record (it did): the
loop then saves the state of the last completed step (:mod:`tightfit.train.loop`).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from tightfit.integrity.interrupts import hold_interrupts
from tightfit.measure.tracker import MemoryTracker
from tightfit.pressure.occupancy import oom_reason, recover_from_oom
from tightfit.train import resume
from tightfit.train.data import MicroBatch
from tightfit.train.memory import optimizer_stats
from tightfit.train.schedule import lr_at

if TYPE_CHECKING:
    from tightfit.train.run_setup import Run

logger = logging.getLogger("tightfit.train")
MiB = 1 << 20


class StepOutOfMemory(RuntimeError):
    """A step ran out of memory in forward/backward and again when retried (or under
    torchrun, where one rank cannot retry alone); the message names the batch and the fix."""


def run_step(run: Run, step: int) -> dict[str, Any]:
    """Train step ``step`` (0-based) and append its record to ``run.history``.

    Returns:
        The record (the loop adds the eval loss to it when this step evaluates).

    Raises:
        StepOutOfMemory: forward/backward ran out of memory twice.
        KeyboardInterrupt: Ctrl-C before the update (the step did not happen) or after the
            record was appended (it did); never in between.
    """
    t, optimizer = run.cfg.train, run.optimizer
    micros = run.data.train.step(step)  # a function of (seed, step)
    lr = lr_at(step, lr=run.cfg.optimizer.lr, schedule=t.lr_schedule,
               warmup=t.warmup_steps, total=t.steps)
    for g in optimizer.param_groups:
        g["lr"] = lr
    run.step_rng = resume.rng_state()  # what a save of the step before this one holds
    tic = time.perf_counter()
    tracked = t.track_every > 0 and step % t.track_every == 0
    loss, tracker, retried = _forward_backward_retried(run, step, micros, tracked)
    # the update and its record: both or neither; under torchrun a save after another
    # rank's failure waits for them (run.job.updating)
    with hold_interrupts(), run.job.updating():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - tic
        stats = optimizer_stats(optimizer)
        rec = _record(run, step, loss, micros, dt, tracker, stats)
        rec["oom_retry"] = retried
        run.oom_retries += int(retried)
        run.history.append(rec)
        run.prev_stats = stats
        run.rng_done = resume.rng_state()  # what a save of this step must hold
    return rec


def _forward_backward_retried(
    run: Run, step: int, micros: list[MicroBatch], tracked: bool
) -> tuple[torch.Tensor, MemoryTracker | None, bool]:
    """Forward, backward and gradient clipping; once more after an out-of-memory error."""
    rng = run.step_rng
    for attempt in (0, 1):
        tracker = MemoryTracker(run.device) if tracked else None
        try:
            if tracker is not None:
                with tracker:
                    loss = _forward_backward(run, micros)
            else:
                loss = _forward_backward(run, micros)
            if run.cfg.train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(run.trainable, run.cfg.train.grad_clip)
            return loss, tracker, attempt == 1
        except torch.OutOfMemoryError as exc:
            what = oom_reason(exc)  # only the line leaves the handler
        # Outside the handler: the error, its traceback and the tensors its frames held (the
        # failed forward's activations) are gone before anything else allocates.
        if attempt == 1 or run.job.distributed:
            _free(run)
            resume.set_rng_state(rng)  # a save of the previous step must resume exactly
            raise StepOutOfMemory(_message(run, step, micros, what, retried=attempt == 1))
        drained = _drain(run.optimizer, what)
        _free(run)
        resume.set_rng_state(rng)
        logger.warning(
            "out of memory in forward/backward of step %d (%s); drained %.1f MiB of optimizer "
            "state off the device and retrying the step once", step + 1, what, drained / MiB)
    raise AssertionError("unreachable")  # pragma: no cover


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


def example_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` with every tensor on ``device``."""
    return {k: v.to(device) for k, v in batch.items()}


def _drain(optimizer: torch.optim.Optimizer, why: str) -> int:
    """Move every evictable optimizer page off the device (an ``oom`` event records why)."""
    pager = getattr(optimizer, "pager", None)
    return recover_from_oom(pager, why) if pager is not None else 0


def _free(run: Run) -> None:
    """Drop what a failed forward/backward left: gradients, garbage, the allocator's cache."""
    run.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def _message(run: Run, step: int, micros: list[MicroBatch], what: str, *, retried: bool) -> str:
    shapes = [tuple(m.inputs["input_ids"].shape) for m in micros]
    longest = max(s[1] for s in shapes)
    batch = ", ".join(f"{r} x {n}" for r, n in shapes)
    info = run.job.info
    when = ("again when retried with the optimizer state off the device" if retried else
            f"on rank {info.rank} of {info.world_size} (under torchrun a rank cannot retry "
            "alone; torchrun stops the other ranks)")
    model = run.cfg.train.model or "<model folder>"
    return (
        f"out of memory in forward/backward of step {step + 1} {when}: {what}. Its batch: "
        f"{batch} tokens (rows x length; the longest {longest} tokens). Nothing of this step "
        f"was applied. To fit: `tightfit plan --model {model} --seq-len {longest}` says what "
        f"fits at that length; pass --seq-len below {longest} (longer examples are "
        "truncated), a smaller --batch-size (with --grad-accum for the same update), a "
        "smaller --checkpoint-budget (more recompute), or a lower --target."
    )


def _record(
    run: Run,
    step: int,
    loss: torch.Tensor,
    micros: list[MicroBatch],
    seconds: float,
    tracker: MemoryTracker | None,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """One step's history record (under torchrun: the global loss and every rank's figures)."""
    prev = run.prev_stats
    tokens = sum(m.tokens for m in micros)
    rec = {
        "step": step + 1,
        "loss": run.job.mean(float(loss.item())),
        "lr": run.optimizer.param_groups[0]["lr"],
        "seconds": seconds,
        "tokens": tokens,  # the examples' tokens, all micro-batches and ranks
        "slots": sum(m.slots for m in micros),  # what was computed, padding included
        "targets": sum(m.targets for m in micros),  # tokens trained
        "longest": max(int(m.inputs["input_ids"].shape[1]) for m in micros),
        "tokens_per_s": tokens / seconds,
        "time": time.monotonic(),  # the clock paging events use
        "device_bytes": int(stats.get("device_bytes", 0)),
        "device_budget": stats.get("device_budget"),
        "target_bytes": stats.get("target_bytes"),
        "activation_peak": tracker.peak_bytes if tracker is not None else None,
        "paged_in": int(stats.get("bytes_paged_in", 0)) - int(prev.get("bytes_paged_in", 0)),
        "paged_out": int(stats.get("bytes_paged_out", 0)) - int(prev.get("bytes_paged_out", 0)),
        "pressure_seconds": float(stats.get("pressure_seconds", 0.0))
        - float(prev.get("pressure_seconds", 0.0)),
        **run.memory.end_step(),
    }
    rec.update(run.job.rank_figures(rec))
    return rec
