"""What offloading checkpointed inputs costs a step: measured on the CPU, estimated for a GPU.

The same model and batch, prepared twice by ``tightfit.prepare`` with ``checkpoint="every"``
(the plan whose segment inputs ``offload="inputs"`` moves) and MLP tiles and the chunked loss
as the long-context stack has them: once ``offload="none"``, once ``offload="inputs"`` (on the
CPU the next tier is the spill file: every checkpointed segment's input is written out in
forward and read back one segment ahead of its backward). Steps alternate between the two
models, so machine load hits both alike; the ratio is the median of the paired per-round
ratios. Beside it, the planner's estimate for a GPU (`tightfit.planner.speed.slowdown`, 20 GB/s
against 100 TFLOP/s): the offload's link time that the compute beside it does not hide, on
this shape and on Llama-3.1-8B.

Run: ``.venv/bin/python benchmarks/offload_cost.py`` (writes benchmarks/results/offload_cost.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from environment import cpu_model, load_text, versions_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_context import batch_of, save_model, step  # noqa: E402

import tightfit  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
MODES = ("none", "inputs")


def build(folder: Path, batch: dict, mode: str, a: argparse.Namespace, spill: str) -> torch.nn.Module:
    torch.manual_seed(1)
    model = tightfit.prepare(folder, lora={"r": a.r, "alpha": 2 * a.r, "dropout": 0.0},
                             checkpoint="every", offload=mode, offload_dir=spill,
                             mlp_tile=a.mlp_tile, loss_chunks="auto",
                             example=batch, device=torch.device("cpu"))
    model.train()
    return model


def planner_rows(folder: Path, tokens: int) -> list[str]:
    from tightfit.planner.estimate import estimate
    from tightfit.planner.presets import load_shape
    from tightfit.planner.speed import offload_exposed_seconds, step_seconds
    from tightfit.planner.train_setup import TrainSetup

    rows = []
    for name, shape, n in (("this benchmark's", load_shape(folder / "config.json"), tokens),
                           ("llama-3.1-8b", load_shape("llama-3.1-8b"), 4096),
                           ("llama-3.1-8b", load_shape("llama-3.1-8b"), 65_536)):
        setup = TrainSetup(seq_len=n, checkpoint="every", loss_chunk_tokens=512,
                           offload="inputs", mlp_tile=min(shape.hidden, n))
        est = estimate(shape, setup)
        exposed = offload_exposed_seconds(shape, est, gpu_tflops=100, link_gbps=20)
        step = step_seconds(shape, setup, 100)
        rows.append(f"| {name} | {n:,} | {est.host_activations / MiB:,.1f} MiB | "
                    f"{1e3 * exposed:.3f} ms | {1e3 * step:.1f} ms | {100 * exposed / step:.2f} % |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--positions", type=int, default=32_768)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--mlp-tile", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(HERE / "results" / "offload_cost.md"))
    a = p.parse_args()
    load0, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as t:
        folder, spill = Path(t) / "model", Path(t) / "spill"
        spill.mkdir()
        save_model(folder, a)
        batch = batch_of(a.tokens, a)
        models = {m: build(folder, batch, m, a, str(spill)) for m in MODES}
        plans = {m: models[m].tightfit_info.plan for m in MODES}
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        secs: dict[str, list[float]] = {m: [] for m in MODES}
        for m in MODES:
            step(models[m], batch, a.device)  # warm-up: the spill file and the copy thread start
        for i in range(a.rounds):
            for m in (MODES if i % 2 == 0 else MODES[::-1]):
                loss, _, s = step(models[m], batch, a.device)  # one forward + backward
                losses[m].append(loss)
                secs[m].append(s)
        rows = planner_rows(folder, a.tokens)
    ratios = [y / x for x, y in zip(secs["none"], secs["inputs"], strict=True)]
    host = plans["inputs"].host_bytes
    lines = [
        "# Offloading checkpointed inputs: the step's cost on the CPU, the planner's for a GPU",
        "",
        f"Model: Llama architecture from a config (random weights), hidden {a.hidden}, "
        f"intermediate {a.intermediate}, {a.layers} layers, {a.heads} / {a.kv_heads} heads, "
        f"vocabulary {a.vocab:,}; NF4 + DQ, LoRA r={a.r} on all linears, `checkpoint=\"every\"`,"
        f" MLP tiles of {a.mlp_tile}, chunked loss; batch 1 × {a.tokens:,} tokens; "
        f"{a.rounds} rounds, the order alternating, after one warm-up step each.",
        f"Machine: {cpu_model()}, {torch.get_num_threads()} torch threads; load "
        f"{load_text(load0)} → {load_text(os.getloadavg())}. {versions_text()}. "
        f"Wall time {(time.perf_counter() - t0) / 60:.1f} min.",
        "", "Run: `.venv/bin/python benchmarks/offload_cost.py`.", "",
        "| offload | segments offloaded | on the next tier | step s (median) | losses |",
        "|---|---:|---:|---:|---|"]
    for m in MODES:
        offl = sum(s.offloads for s in plans[m].segments)
        lines.append(f"| {m} | {offl} | {plans[m].host_bytes / MiB:.1f} MiB | "
                     f"{statistics.median(secs[m]):.3f} | "
                     f"{', '.join(f'{x:.4f}' for x in losses[m][:3])} … |")
    same = losses["none"] == losses["inputs"]
    lines += [
        "", f"Paired step-time ratio inputs / none: {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"median **{statistics.median(ratios):.3f}×** ({host / MiB:.1f} MiB out and back a step "
        f"through the spill file; on the CPU the copy thread shares the cores with the compute, "
        f"so nothing of a move is hidden). Losses equal step by step: **{'yes' if same else 'NO'}**.",
        "", "The planner's estimate for a GPU (20 GB/s link, 100 TFLOP/s; the same plan: every "
        "layer checkpointed, its input offloaded, loss chunks of 512): the offload's link time "
        "that the compute beside it does not hide, against the plain step's compute.", "",
        "| shape | tokens | inputs on the host | link time not hidden | plain step compute | "
        "exposed / step |", "|---|---|---|---|---|---|", *rows]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(Path(a.out).read_text())


if __name__ == "__main__":
    main()
