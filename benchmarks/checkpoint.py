"""Checkpoint plans on a Llama-architecture model: measured peak vs predicted, and step time.

Rows: every tightfit policy, budget plans at several budgets, torch's
``checkpoint_sequential`` and Hugging Face's ``gradient_checkpointing_enable()``, all measured
the same way — one training step (forward + backward, fp32) under ``MemoryTracker`` (peak live
tensor bytes allocated by the step: activations, their gradients, the parameter gradients)
and the CPU time of an untracked step divided by that of a no-checkpoint step run next to it
(median over ``--reps`` pairs). The machine is shared: process CPU time with one torch
thread is what other jobs' load disturbs least; wall time under load is meaningless. With tightfit's
chunked head + loss (``tightfit.loss``) available,
"+ chunked head+loss" rows repeat budget/every with it.

    .venv/bin/python benchmarks/checkpoint.py            # 16 layers, hidden 256, 2 x 512 tokens
    .venv/bin/python benchmarks/checkpoint.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from environment import cpu_model, load_text, versions_text
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import tightfit.checkpoint as ck
from tightfit.measure.tracker import MemoryTracker

MIB = 1024 * 1024
OUT = Path(__file__).parent / "results" / "checkpoint.md"


def build(args: argparse.Namespace) -> tuple[nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
                      max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    return model, {"input_ids": x, "labels": x}


def step(model: nn.Module, batch: dict) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def measure(model: nn.Module, batch: dict, reps: int, install: Callable[[], Callable[[], None]],
            ) -> tuple[int, float]:
    """Peak bytes of a tracked step and the median step-time ratio to no checkpointing.

    The tracked step is not timed (counting storages costs time per op). Each repetition then
    times one step with the configuration and one without, back to back and in alternating
    order, so load changes on the shared machine hit both sides of the ratio alike.
    """
    undo = install()
    with MemoryTracker("cpu") as mt:
        step(model, batch)
    undo()
    ratios = []
    for r in range(reps):
        secs = {}
        for with_config in ((True, False) if r % 2 == 0 else (False, True)):
            undo = install() if with_config else (lambda: None)
            t0 = time.process_time()  # CPU seconds of this process: others' load adds none
            step(model, batch)
            secs[with_config] = time.process_time() - t0
            undo()
        ratios.append(secs[True] / secs[False])
    model.zero_grad(set_to_none=True)
    return mt.peak_bytes, statistics.median(ratios)


def torch_sequential(model: nn.Module, segments: int) -> Callable[[], None]:
    """Run the decoder layers through ``torch.utils.checkpoint.checkpoint_sequential``.

    HF layers take keyword arguments (mask, rotary tables), so the first layer's forward runs
    all layers as an ``nn.Sequential`` of adapters bound to this call's keywords and the
    others pass their input through. Returns the undo function.
    """
    layers = list(model.model.layers)

    class Bound(nn.Module):
        def __init__(self, fn: Callable, kw: dict) -> None:
            super().__init__()
            self.fn, self.kw = fn, kw

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.fn(h, **self.kw)

    originals = [layer.forward for layer in layers]

    def first(hidden: torch.Tensor, **kw: object) -> torch.Tensor:
        seq = nn.Sequential(*[Bound(f, kw) for f in originals])
        return checkpoint_sequential(seq, segments, hidden, use_reentrant=False)

    layers[0].forward = first
    for layer in layers[1:]:
        layer.forward = lambda hidden, **kw: hidden

    def undo() -> None:
        for layer in layers:
            del layer.forward

    return undo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=2, help="timed pairs per row (median ratio)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: CPU time then measures the work, not the waiting)")
    p.add_argument("--quick", action="store_true", help="8 layers, hidden 128, 2 x 128 tokens")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.quick:
        args.layers, args.hidden, args.seq, args.vocab = 8, 128, 128, 4096
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    load = os.getloadavg()
    t_start = time.time()
    model, batch = build(args)
    step(model, batch)  # warm-up
    prof = ck.profile(model, batch)
    rows: list[tuple[str, int, int | None, float | None, float, str]] = []

    def row(name: str, install: Callable[[], Callable[[], None]], plan: ck.Plan | None = None,
            note: str = "") -> None:
        peak, ratio = measure(model, batch, args.reps, install)
        pred = plan.predicted_peak_bytes if plan else None
        rec = plan.predicted_recompute_fraction if plan else None
        rows.append((name, peak, pred, rec, ratio, note))
        print(f"{name:36s} {peak / MIB:8.1f} MiB  pred {(pred or 0) / MIB:8.1f}  x{ratio:5.2f}",
              flush=True)

    def policy(pol: str, profiled: ck.Profile, budget: int | None = None
               ) -> tuple[Callable[[], Callable[[], None]], ck.Plan]:
        plan = ck.enable(model, pol, budget=budget, profiled=profiled)
        ck.disable(model)

        def install() -> Callable[[], None]:
            ck.enable(model, pol, budget=budget, profiled=profiled)
            return lambda: ck.disable(model)

        return install, plan

    for pol in ["none", "every", "sqrt", "uniform:2", "selective"]:
        install, plan = policy(pol, prof)
        row(pol, install, plan, f"{plan.checkpointed_blocks} blocks recomputed" if
            plan.checkpointed_blocks else "")
    from tightfit.checkpoint.solver import min_peak

    lo, hi = min_peak(prof), prof.peak_bytes
    for frac in (0.0, 0.1, 0.3, 0.6):
        b = int(lo + frac * (hi - lo))
        install, plan = policy("budget", prof, b)
        kinds = ", ".join(f"{sum(s.kind == k for s in plan.segments)} {k}" for k in
                          ("checkpoint", "selective") if any(s.kind == k for s in plan.segments))
        row(f"budget {b / MIB:.0f} MiB", install, plan,
            f"{plan.checkpointed_blocks} blocks recomputed ({kinds} segments)")
    k = max(1, round(math.sqrt(args.layers)))
    row(f"torch checkpoint_sequential({k})", lambda: torch_sequential(model, k), None,
        "last segment not checkpointed")

    def hf() -> Callable[[], None]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.gradient_checkpointing_disable

    row("HF gradient_checkpointing_enable()", hf, None, "every layer, non-reentrant")
    try:
        from tightfit.loss import disable_chunked_loss, enable_chunked_loss
    except ImportError:
        enable_chunked_loss = None
    if enable_chunked_loss is not None:
        enable_chunked_loss(model, "auto")
        cprof = ck.profile(model, batch)  # the tail as it now runs: chunked
        disable_chunked_loss(model)

        def chunked(pol: str, budget: int | None = None) -> Callable[[], Callable[[], None]]:
            def install() -> Callable[[], None]:
                enable_chunked_loss(model, "auto")
                ck.enable(model, pol, budget=budget, profiled=cprof)

                def undo() -> None:
                    ck.disable(model)
                    disable_chunked_loss(model)
                return undo
            return install

        plan = ck.enable(model, "every", profiled=cprof)
        ck.disable(model)
        row("every + chunked head+loss", chunked("every"), plan,
            f"peak of the unchecked step while head+loss run: "
            f"{cprof.tail_peak_bytes / MIB:.0f} MiB (unchunked {prof.tail_peak_bytes / MIB:.0f})")
        b = min_peak(cprof)
        plan = ck.enable(model, "budget", budget=b, profiled=cprof)
        ck.disable(model)
        row(f"budget {b / MIB:.0f} MiB + chunked head+loss", chunked("budget", b), plan,
            f"{plan.checkpointed_blocks} blocks recomputed")
    write(args, rows, load, time.time() - t_start, prof)
    return 0


def write(args: argparse.Namespace, rows: list, load: tuple, wall: float, prof: object) -> None:
    lines = [
        "# Checkpoint plans: measured vs predicted peak, step time",
        "",
        f"Model: Llama architecture from a config, {args.layers} layers, hidden {args.hidden}, "
        f"vocabulary {args.vocab}, {args.batch} x {args.seq} tokens, fp32, CPU, full fine-tune "
        "(every parameter trains). Peak = bytes one training step allocates on top of the "
        "model (activations, their gradients, parameter gradients), measured with "
        "`MemoryTracker` (live CPU storages). Predicted = the plan's prediction from one "
        "profile of the unchecked step. Time ratio = process CPU time of a step ÷ that of a "
        "no-checkpoint "
        f"step timed next to it (alternating order), median over {args.reps} pair(s) per row. "
        "Predicted "
        "(1 + recompute) = 1 + the plan's predicted recompute time ÷ the profiled step time.",
        "",
        "| policy | measured peak MiB | predicted MiB | measured ÷ predicted | step time ÷ none "
        "| predicted (1 + recompute) | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, peak, pred, rec, ratio, note in rows:
        mp = f"{peak / pred:.3f}" if pred else "–"
        pred_s = f"{pred / MIB:.1f}" if pred else "–"
        rec_s = f"{1 + rec:.2f}" if rec is not None else "–"
        lines.append(f"| {name} | {peak / MIB:.1f} | {pred_s} | {mp} | {ratio:.2f} | {rec_s} | "
                     f"{note} |")
    lines += [
        "",
        f"Profile of the unchecked step: head + loss after the chain peak at "
        f"{prof.tail_peak_bytes / MIB:.1f} MiB with {prof.tail_saved_bytes / MIB:.1f} MiB saved "
        f"for backward; the {args.layers} blocks save "
        f"{sum(b.saved_bytes for b in prof.blocks) / MIB:.1f} MiB.",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, torch threads {args.threads}; load average at "
        f"start {load_text(load)} — a machine shared with other "
        "engineers' jobs, so times are noisy; memory is not affected. "
        f"Wall time {wall:.0f} s.",
        f"Versions: {versions_text()}.",
        f"Command: `.venv/bin/python benchmarks/checkpoint.py {'--quick ' if args.quick else ''}"
        f"--layers {args.layers} --hidden {args.hidden} --seq {args.seq} --batch {args.batch} "
        f"--vocab {args.vocab} --reps {args.reps} --threads {args.threads}`",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
