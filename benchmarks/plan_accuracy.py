"""How close is ``tightfit plan``'s memory model? Predicted vs measured bytes, piece by piece.

Runs real training steps of small Llama-architecture models on this machine (tightfit's
``prepare`` + checkpoint plans + optimizers, measured with MemoryTracker) and writes
``benchmarks/results/plan_accuracy.md``: predicted, measured and the error for weights,
quantization constants, LoRA, grads, optimizer state, activation peaks under
none/every/sqrt/budget, and the head + loss. Memory only — no timings.

    .venv/bin/python benchmarks/plan_accuracy.py [--quick]
    .venv/bin/python benchmarks/plan_accuracy.py --long-context

``--long-context`` measures the long-context setups instead (activation offload to the CPU's
next tier, the tiled MLP; the mechanisms of ``tightfit.checkpoint``) on shapes no planner
constant was fitted on, and writes ``benchmarks/results/plan_accuracy_longctx.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from environment import cpu_model, load_text, versions_text

from tightfit.checkpoint.plan import structural_segments
from tightfit.planner.mechanisms import unavailable
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


GQA5 = ModelShape("h160-L5-gqa5", 160, 432, 5, 5, 1, 3000)
MHA48 = ModelShape("h64-L6-mha-hd48-tied", 64, 224, 6, 2, 2, 4096, head_dim=48,
                   tie_embeddings=True)
_BF16_NF4 = dict(compute_dtype="bfloat16", quant="nf4", loss_chunk_tokens=64)
_FP32 = dict(compute_dtype="float32", quant="none", loss_chunk_tokens=64)
LONG_CASES = [
    (GQA5, dict(seq_len=192, checkpoint="every", **_BF16_NF4)),
    (GQA5, dict(seq_len=192, checkpoint="every", offload="inputs", **_BF16_NF4)),
    (GQA5, dict(seq_len=192, checkpoint="every", offload="inputs", mlp_tile=48, **_BF16_NF4)),
    (GQA5, dict(seq_len=96, batch=2, checkpoint="every", offload="inputs", mlp_tile=32, **_FP32)),
    (GQA5, dict(seq_len=128, offload="all", **_FP32)),
    (MHA48, dict(seq_len=160, batch=2, checkpoint="sqrt", offload="inputs", mlp_tile=100,
                 compute_dtype="bfloat16", quant="none", loss_chunk_tokens=80)),
    (MHA48, dict(seq_len=128, offload="all", **_BF16_NF4)),
]


def _header(title: str) -> list[str]:
    load = os.getloadavg()
    return [
        f"# {title}",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, load average at start "
        f"{load_text(load, digits=1)} (shared machine; memory figures do not "
        "depend on load).",
        f"Versions: {versions_text()}.",
        "",
    ]


def long_context(out: str) -> None:
    """The long-context setups: one real step each, activation peak predicted vs measured."""
    lines = _header("tightfit plan: long-context setups, predicted vs measured bytes") + [
        "One real step per setup on the CPU (tensor bytes, MemoryTracker), LoRA r=8. Offloaded "
        "segments go to the CPU's next tier (a spill file, every storage moved); the tiled MLP "
        "is `tightfit.checkpoint.tiling`. error = (predicted − measured) / measured.",
        "",
        "| model | setup | piece | predicted | measured | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for shape, kw in LONG_CASES:
        setup = TrainSetup(lora_r=8, **kw)
        label = ", ".join(f"{k}={v}" for k, v in kw.items())
        why = unavailable(setup)
        if why is not None:
            lines.append(f"| {shape.name} | {label} | not measured: {why} | | | |")
            continue
        for piece, pred, meas in compare(shape, setup, (setup.checkpoint,))[setup.checkpoint]:
            if piece not in ("activations", "logits_loss"):
                continue
            err = (pred - meas) / meas if meas else 0.0
            lines.append(f"| {shape.name} | {label} | {piece} | {pred} | {meas} "
                         f"| {100 * err:+.2f} % |")
        print(f"done: {shape.name} {label}", flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first case only")
    ap.add_argument("--long-context", action="store_true",
                    help="the offload / tiled-MLP setups instead (their own results file)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.long_context:
        long_context(args.out or "benchmarks/results/plan_accuracy_longctx.md")
        return
    args.out = args.out or "benchmarks/results/plan_accuracy.md"
    lines = _header("tightfit plan: predicted vs measured bytes") + [
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
