"""The training loop behind ``tightfit train``: set up, run the steps, finish.

:func:`train` is three calls: :func:`tightfit.train.run_setup.setup` checks everything and builds
the run (nothing is written before every check passed), :func:`run_steps` trains (each step is
:func:`tightfit.train.step.run_step`), evaluates every ``--eval-every`` steps and saves the
resume state every ``--save-every`` steps, and :func:`finish` publishes the adapter, measures
the report and draws the plots.

Stopping early loses nothing done: on Ctrl-C or SIGTERM (which the command line raises as an
interrupt, :func:`tightfit.integrity.interrupts.terminate_as_interrupt`), or when a step runs
out of memory even when retried, the loop saves the state of the last completed step (when
the last save is older) and raises :class:`TrainInterrupted` or
:class:`~tightfit.train.step.StepOutOfMemory` with a message saying where it is and how to
continue. Under torchrun the ranks cannot agree on a
save in that moment, so the last periodic save stands.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tightfit.integrity.interrupts import interrupt_signal
from tightfit.report.report import MemoryReport, measure_report
from tightfit.report.text import WIDTH
from tightfit.train import resume
from tightfit.train.eval import evaluate
from tightfit.train.memory import optimizer_stats
from tightfit.train.plots import plot_loss, plot_ranks, plot_timeline
from tightfit.train.predicted import predicted_without_pass
from tightfit.train.quiet import library_bars
from tightfit.train.run_options import RunConfig, TrainOptions
from tightfit.train.run_setup import Run, setup
from tightfit.train.step import StepOutOfMemory, example_on, run_step
from tightfit.train.summary import describe_run

__all__ = ["RunConfig", "TrainInterrupted", "TrainOptions", "TrainResult", "finish", "run_steps",
           "train"]

logger = logging.getLogger("tightfit.train")


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during ``tightfit train``; the message says what was saved and how to
    resume, ``signum`` which signal it was."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


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
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Run ``tightfit train``.

    Args:
        cfg: The run's options.
        progress: Show a progress bar (loss, tokens/s, device-tier occupancy); without it
            transformers' and datasets' bars are off too.
        log: Where messages go (default: the ``tightfit.train`` logger at INFO).

    Returns:
        The output folder, the per-step history, the memory report and the files written.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad input, before training starts.
        TrainInterrupted: Ctrl-C (or SIGTERM under the command line); the state of the last
            completed step is saved.
        StepOutOfMemory: a step ran out of memory twice; the last completed step is saved.
    """
    with library_bars(progress):  # without a bar of ours, none of transformers' or datasets'
        run = setup(cfg, progress=progress, log=log or logger.info)
        try:
            run_steps(run)
            return finish(run)
        finally:
            close_run(run)


def run_steps(run: Run) -> None:
    """Train from ``run.start`` to ``--steps``, evaluating and saving the resume state on schedule.

    Raises:
        FloatingPointError: the loss is not finite.
        TrainInterrupted, StepOutOfMemory: see :func:`train`.
    """
    t = run.cfg.train
    bar = _progress(run.start, t.steps, run.progress)
    run.prev_stats = optimizer_stats(run.optimizer)
    run.model.train()
    # under torchrun: another rank's failure reaches this one's watcher thread, which joins
    # the one collective save of the last completed step
    run.job.on_peer_failure(lambda group: _save_after_stop(run, group))
    try:
        for step in range(run.start, t.steps):
            rec = run_step(run, step)
            if run.data.eval is not None and (step + 1 == t.steps or (
                    t.eval_every and (step + 1) % t.eval_every == 0)):
                rec.update(evaluate(run))
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss is {rec['loss']} at step {step + 1}; lower --lr.")
            _update_bar(bar, rec)
            logger.debug("step %d done: loss %.4f, %.3f s", rec["step"], rec["loss"],
                         rec["seconds"])
            if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
                run.saving = True
                run.last_saved = run.job.save_state(run.out, step + 1, run.model, run.optimizer,
                                                    run.history)
                run.saving = False
    except KeyboardInterrupt as exc:
        _raise_if_peer_failed(run)
        signum = interrupt_signal(exc)
        what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
        raise TrainInterrupted(f"{what}; {_save_after_stop(run)}", signum) from None
    except StepOutOfMemory as exc:
        if not run.job.distributed:
            raise StepOutOfMemory(f"{exc} {_save_after_stop(run)}") from None
        said: list[str] = []
        # the other ranks wait in a collective this rank will not join: they learn of it
        # through torchrun's store, and all save the last completed step once, together
        try:
            run.job.fail(str(exc), lambda group: said.append(_save_after_stop(run, group)))
        except Exception as err:  # noqa: BLE001 (the out-of-memory line must still be said)
            said.append(f"the last completed step could not be saved ({type(err).__name__}: "
                        f"{err}); the newest saved state in {run.out} is the one to resume.")
        raise StepOutOfMemory(f"{exc} {said[0] if said else _save_after_stop(run)}") from None
    except Exception:
        _raise_if_peer_failed(run)  # the dead collective's error once the failed rank left
        raise
    finally:
        if bar is not None:
            bar.close()


class RankStopped(RuntimeError):
    """Another rank failed in its step under torchrun; this rank joined the save of the last
    completed step and stops without a line of its own (the failed rank's names it)."""


def _raise_if_peer_failed(run: Run) -> None:
    line = run.job.peer_failed
    if line is not None:
        raise RankStopped(f"stopped: another rank failed ({line.split(':')[0]})") from None


def _save_after_stop(run: Run, group: Any = None) -> str:
    """Save the last completed step unless the newest saved state holds it; say where it is.

    Under torchrun only after a rank failed in its step, with ``group`` (the save group of
    :mod:`tightfit.distributed.stop`): every rank runs it at once, deciding alike (the same
    history, the same last save), so the state is written once. An interrupt there saves
    nothing (the ranks may be anywhere in the step).
    """
    done = int(run.history[-1]["step"]) if run.history else run.start
    # a state this process saved: its step is in its name (no need to hash its files again)
    saved = resume.state_step(run.last_saved) if run.last_saved is not None else 0
    if done > saved and not run.saving and not run.job.distributed:
        # the RNG as that step left it (a half-done step after it may have drawn from it)
        resume.set_rng_state(run.rng_done)
        run.last_saved = resume.save_state(run.out, done, run.model, run.optimizer, run.history)
        saved = done
    elif done > saved and not run.saving and group is not None:
        run.last_saved = run.job.save_state(run.out, done, run.model, run.optimizer,
                                            run.history, rng=run.rng_done, group=group)
        saved = done
    if run.last_saved is None:
        return f"no step was completed, nothing saved in {run.out}."
    lost = f" (steps {saved + 1}-{done} are lost: a save was cut short)" if done > saved else ""
    return (f"the state of step {saved} is saved in {run.out}{lost}; continue with "
            f"`tightfit train --resume {run.out}`.")


def finish(run: Run) -> TrainResult:
    """Publish the adapter, measure and write the report and the plots."""
    t, job, optimizer, history, out = run.cfg.train, run.job, run.optimizer, run.history, run.out
    files: dict[str, Path] = {}
    if job.is_main and run.last_saved is not None:
        # first: measuring the report runs the longest batch without the pieces, which may
        # need more memory than training did; the trained adapter is safe before that
        files["adapter"] = resume.publish_adapter(out, run.last_saved)
        files["saved_state"] = run.last_saved
    stats = optimizer_stats(optimizer)  # before the report's own passes move anything
    report = measure_report(run.model, example_on(job.rows(run.example), run.device),
                            optimizer=optimizer, base_numel=run.info.base_numel,
                            without_activation_bytes=predicted_without_pass(run, stats))
    report.meta.update(job.report_meta(optimizer))
    report.meta.update({"steps": t.steps, **_data_meta(run)})
    describe_run(report, run, stats)
    if job.is_main:
        files = {**report.save(out), **files}
        files["loss_png"] = plot_loss(history, out / "loss_curve.png")
        files["timeline_png"] = plot_timeline(history, out / "memory_timeline.png",
                                              optimizer_events(optimizer))
        if job.distributed:
            files["ranks_png"] = plot_ranks(history, out / "memory_ranks.png")
    return TrainResult(out, history, report, files, list(run.info.notes))


def close_run(run: Run) -> None:
    """Release the optimizer (pages, spill files, hooks), the data's temp folder and the job."""
    close = getattr(run.optimizer, "close", None)
    if callable(close):
        close()
    run.data.close()
    run.job.close()


def _data_meta(run: Run) -> dict[str, Any]:
    """What was trained on, the trained tokens, how full the batches were, the eval losses."""
    h = run.history
    tokens, slots = sum(x.get("tokens", 0) for x in h), sum(x.get("slots", 0) for x in h)
    evals = [{k: x[k] for k in ("step", "eval_loss", "eval_perplexity", "eval_tokens")}
             for x in h if x.get("eval_loss") is not None]
    return {
        "tokens_per_s_median": _median([x["tokens_per_s"] for x in h]),
        "first_loss": h[0]["loss"] if h else None,
        "last_loss": h[-1]["loss"] if h else None,
        "data": run.data.summary,
        "trained_tokens": sum(x.get("targets", 0) for x in h),
        # padding (bucket) or packing (pack) efficiency: the examples' share of what was computed
        "batch_efficiency": {"batching": run.cfg.data.batching, "tokens": tokens, "slots": slots,
                             "efficiency": tokens / slots if slots else None},
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_perplexity": evals[-1]["eval_perplexity"] if evals else None,
        "eval": evals,
    }


def optimizer_events(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The paged optimizer's paging events (none for torch's optimizers)."""
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

    cols = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)  # fits 100 columns
    return tqdm(total=total, initial=start, desc="train", unit="step", ncols=cols)


def _update_bar(bar: Any, rec: dict[str, Any]) -> None:
    if bar is None:
        return
    mib = rec["device_bytes"] / 2**20  # MiB, as everywhere (the report, the plots, --device-budget's note)
    occ = f"{mib:.{2 if mib < 100 else 0}f}MiB"
    shown = {"loss": f"{rec['loss']:.3f}", "tok_s": f"{rec['tokens_per_s']:.0f}", "dev": occ}
    if rec.get("eval_loss") is not None:
        bar.last_eval = f"{rec['eval_loss']:.3f}"
    if getattr(bar, "last_eval", None) is not None:
        shown["eval"] = bar.last_eval
    bar.set_postfix(shown, refresh=False)
    bar.update(1)
