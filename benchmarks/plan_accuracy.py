"""How close is ``tightfit plan``'s memory model? Predicted vs measured bytes, piece by piece.

Runs real training steps of small Llama-architecture models on this machine (tightfit's
``prepare`` + checkpoint plans + optimizers, measured with MemoryTracker) and writes
``benchmarks/results/plan_accuracy.md``: predicted, measured and the error for weights,
quantization constants, LoRA, grads, optimizer state, activation peaks under
none/every/sqrt/budget, and the head + loss. Memory only — no timings.

    .venv/bin/python benchmarks/plan_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from environment import cpu_model, load_text, versions_text

from tightfit.checkpoint.plan import structural_segments
from tightfit.planner.peak import plan_peak
from tightfit.planner.presets import ModelShape
from tightfit.planner.setup import TrainSetup
from tightfit.planner.verify import compare

GQA = ModelShape("h128-i352-L3-gqa2", 128, 352, 3, 4, 2, 1000)
TIED = ModelShape("h96-i256-L4-gqa3-tied", 96, 256, 4, 3, 1, 2048, tie_embeddings=True)
MHA = ModelShape("h192-i512-L3-mha", 192, 512, 3, 6, 6, 512)

CASES = [
    (GQA, dict(compute_dtype="float32", quant="nf4", double_quant=True)),
    (TIED, dict(compute_dtype="bfloat16", quant="nf4", double_quant=False,
                optimizer="paged_adamw8bit")),
    (MHA, dict(compute_dtype="bfloat16", quant="none", loss_chunk_tokens=16,
               optimizer="paged_adamw8bit")),
    (MHA, dict(compute_dtype="bfloat16", quant="nf4", loss_chunk_tokens=16)),
    (GQA, dict(compute_dtype="bfloat16", quant="nf4", lora_dropout=0.1)),
    (GQA, dict(compute_dtype="bfloat16", quant="nf4", lora_targets=("q_proj", "v_proj"))),
    (GQA, dict(compute_dtype="float32", quant="int8")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first case only")
    ap.add_argument("--out", default="benchmarks/results/plan_accuracy.md")
    args = ap.parse_args()
    load = os.getloadavg()
    lines = [
        "# tightfit plan: predicted vs measured bytes",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, load average at start "
        f"{load_text(load, digits=1)} (shared machine; memory figures do not "
        "depend on load).",
        f"Versions: {versions_text()}.",
        "",
        "One real step per plan on the CPU (tensor bytes, MemoryTracker), batch 2 × 32 tokens, "
        "LoRA r=8; error = (predicted − measured) / measured. `budget` is the memory model's "
        "own plan for a budget halfway between its `none` and `every` peaks.",
        "",
        "| model | setup | policy | piece | predicted | measured | error |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for shape, kw in CASES[:1] if args.quick else CASES:
        setup = TrainSetup(seq_len=32, batch=2, lora_r=8, **kw)
        none = sum(plan_peak(shape, setup, structural_segments("none", None, shape.layers)))
        every = sum(plan_peak(shape, setup, structural_segments("every", None, shape.layers)))
        setup = setup.with_(checkpoint_budget=(none + every) // 2)
        label = ", ".join(f"{k}={v}" for k, v in kw.items())
        for policy, rows in compare(shape, setup, ("none", "every", "sqrt", "budget")).items():
            for piece, pred, meas in rows:
                if policy != "none" and piece != "activations":
                    continue  # the other pieces do not depend on the plan
                err = (pred - meas) / meas if meas else 0.0
                lines.append(f"| {shape.name} | {label} | {policy} | {piece} | {pred} | {meas} "
                             f"| {100 * err:+.2f} % |")
        print(f"done: {shape.name} {label}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
