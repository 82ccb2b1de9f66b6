"""Checkpoint plans on a Llama-architecture model: measured peak vs predicted, and step time.

Rows: every tightfit policy, budget plans at several budgets, torch's
``checkpoint_sequential`` and Hugging Face's ``gradient_checkpointing_enable()``, all measured
the same way — one training step (forward + backward, fp32) under ``MemoryTracker`` (peak live
tensor bytes allocated by the step: activations, their gradients, the parameter gradients)
and the median step time of ``--reps`` untracked steps, divided by the no-checkpoint
median of the same run. With tightfit's chunked head + loss (``tightfit.loss``) available,
"+ chunked head+loss" rows repeat budget/every with it.

    .venv/bin/python benchmarks/checkpoint.py            # 16 layers, hidden 256, 2 x 512 tokens
    .venv/bin/python benchmarks/checkpoint.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import tightfit.checkpoint as ck
from tightfit.memory.tracker import MemoryTracker

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


def measure(model: nn.Module, batch: dict, reps: int) -> tuple[int, float]:
    """Peak bytes of one tracked step; median seconds of ``reps`` untracked steps."""
    with MemoryTracker("cpu") as mt:
        step(model, batch)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(model, batch)
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return mt.peak_bytes, statistics.median(times)


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
    p.add_argument("--reps", type=int, default=1, help="timed steps per row (median)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
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
    rows: list[tuple[str, int, int | None, float, str]] = []

    def row(name: str, predicted: int | None, note: str = "") -> None:
        peak, secs = measure(model, batch, args.reps)
        rows.append((name, peak, predicted, secs, note))
        print(f"{name:34s} {peak / MIB:8.1f} MiB  pred {predicted and predicted / MIB or 0:8.1f}"
              f"  {secs:7.2f} s", flush=True)

    row("none", ck.enable(model, "none", profiled=prof).predicted_peak_bytes)
    ck.disable(model)
    for pol in ["every", "sqrt", "uniform:2", "selective"]:
        plan = ck.enable(model, pol, profiled=prof)
        row(pol, plan.predicted_peak_bytes, f"{plan.checkpointed_blocks} blocks recomputed")
        ck.disable(model)
    lo = ck.enable(model, "every", profiled=prof).predicted_peak_bytes
    ck.disable(model)
    from tightfit.checkpoint.solver import min_peak

    lo = min(lo, min_peak(prof))
    hi = prof.peak_bytes
    for frac in (0.0, 0.1, 0.3, 0.6):
        b = int(lo + frac * (hi - lo))
        plan = ck.enable(model, "budget", budget=b, profiled=prof)
        row(f"budget {b / MIB:.0f} MiB", plan.predicted_peak_bytes,
            f"{plan.checkpointed_blocks} blocks recomputed, "
            f"{sum(s.kind != 'stored' for s in plan.segments)} segments")
        ck.disable(model)
    k = max(1, round(math.sqrt(args.layers)))
    undo = torch_sequential(model, k)
    row(f"torch checkpoint_sequential({k})", None, "last segment not checkpointed")
    undo()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    row("HF gradient_checkpointing_enable()", None, "every layer, non-reentrant")
    model.gradient_checkpointing_disable()
    try:
        from tightfit.loss import disable_chunked_loss, enable_chunked_loss
    except ImportError:
        enable_chunked_loss = None
    if enable_chunked_loss is not None:
        enable_chunked_loss(model, "auto")
        cprof = ck.profile(model, batch)  # the tail as it now runs: chunked
        plan = ck.enable(model, "every", profiled=cprof)
        row("every + chunked head+loss", plan.predicted_peak_bytes)
        ck.disable(model)
        from tightfit.checkpoint.solver import min_peak as mp

        b = mp(cprof)
        plan = ck.enable(model, "budget", budget=b, profiled=cprof)
        row(f"budget {b / MIB:.0f} MiB + chunked head+loss", plan.predicted_peak_bytes,
            f"{plan.checkpointed_blocks} blocks recomputed")
        ck.disable(model)
        disable_chunked_loss(model)
    write(args, rows, load, time.time() - t_start, prof)
    return 0


def write(args: argparse.Namespace, rows: list, load: tuple, wall: float, prof: object) -> None:
    import bitsandbytes
    import peft
    import transformers

    base = rows[0][3]
    lines = [
        "# Checkpoint plans: measured vs predicted peak, step time",
        "",
        f"Model: Llama architecture from a config, {args.layers} layers, hidden {args.hidden}, "
        f"vocabulary {args.vocab}, {args.batch} x {args.seq} tokens, fp32, CPU, full fine-tune "
        "(every parameter trains). Peak = bytes one training step allocates on top of the "
        "model (activations, their gradients, parameter gradients), measured with "
        "`MemoryTracker` (live CPU storages). Predicted = the plan's prediction from one "
        "profile of the unchecked step. Time ratio = median step time ÷ the no-checkpoint "
        f"median of this run ({args.reps} timed step(s) per row).",
        "",
        "| policy | measured peak MiB | predicted MiB | measured ÷ predicted | step time ÷ none | "
        "notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, peak, pred, secs, note in rows:
        ratio = f"{peak / pred:.3f}" if pred else "–"
        pred_s = f"{pred / MIB:.1f}" if pred else "–"
        lines.append(f"| {name} | {peak / MIB:.1f} | {pred_s} | {ratio} | {secs / base:.2f} | "
                     f"{note} |")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines += [
        "",
        f"Profile of the unchecked step: head + loss after the chain peak at "
        f"{prof.tail_peak_bytes / MIB:.1f} MiB with {prof.tail_saved_bytes / MIB:.1f} MiB saved "
        f"for backward; the {args.layers} blocks save "
        f"{sum(b.saved_bytes for b in prof.blocks) / MIB:.1f} MiB.",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch threads {args.threads}; load average at "
        f"start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} — a machine shared with other "
        "engineers' jobs, so times are noisy; memory is not affected. "
        f"Wall time {wall:.0f} s.",
        f"Versions: torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, "
        f"transformers {transformers.__version__}, peft {peft.__version__}.",
        f"Command: `.venv/bin/python benchmarks/checkpoint.py {'--quick ' if args.quick else ''}"
        f"--layers {args.layers} --hidden {args.hidden} --seq {args.seq} --batch {args.batch} "
        f"--vocab {args.vocab} --reps {args.reps} --threads {args.threads}`",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
