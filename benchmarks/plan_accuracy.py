"""How close is ``tightfit plan``'s memory model? Predicted vs measured bytes, piece by piece.

Runs real training steps of small Llama-architecture models on this machine (tightfit's
``prepare`` + checkpoint plans + optimizers, measured with MemoryTracker) and writes
``benchmarks/results/plan_accuracy.md``: predicted, measured and the error for weights,
quantization constants, LoRA, grads, optimizer state, activation peaks under
none/every/sqrt/budget, and the head + loss. Memory only — no timings.

    .venv/bin/python benchmarks/plan_accuracy.py [--quick]
    .venv/bin/python benchmarks/plan_accuracy.py --long-context

The families section (every modelled family: llama, mistral, qwen2, qwen3, gemma, gemma2,
gemma3, phi3, mixtral, qwen3_moe) runs on held-out shapes (:data:`HELD_OUT`: widths, depths,
vocabularies and head sizes no planner constant was fitted on; :data:`FITTED` names the
shapes the constants came from) and ends with the worst error per piece and family.
``--families`` runs only that section.

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
from tightfit.planner.train_setup import TrainSetup
from tightfit.planner.verify import compare

# The shapes the planner's fitted constants came from (BWD_I / BWD_H16 and the dropout
# copy: small Llama configs of tests/planner/test_estimate.py; ROUTE_PAIR / ROUTE_TOKEN:
# tiny Mixtral configs, hidden 256, expert width 512, E = 4 and 8, top-2 and top-3;
# BWD_SCORES: small Gemma 2 configs, hidden 128-256). Named here so that HELD_OUT can differ.
FITTED = (
    "llama: h128 i352 L3-5 heads 4/2, vocab 1000 (tests/planner/test_estimate.py)",
    "mixtral: h256 i512 E8 top-2 and E4 top-2/top-3, vocab 1000",
    "gemma2: h128-256, vocab 1000",
    "(not a byte fit: GEMMA_NORM_BWD = 5, the live fp32 tensors of a Gemma norm's backward, "
    "was counted off the tensor listing of the held-out gemma2-h96 bf16 step)",
)
_SW = "sliding_attention"
_FA = "full_attention"
HELD_OUT = (
    ModelShape("llama-h160-L4-kv1-v3001", 160, 432, 4, 5, 1, 3001),
    ModelShape("mistral-h96-L3-w24", 96, 256, 3, 3, 1, 1536, family="mistral",
               sliding_window=24),
    ModelShape("qwen2-h192-L2-tied-v777", 192, 512, 2, 6, 2, 777, family="qwen2",
               tie_embeddings=True),
    ModelShape("qwen3-h96-hd40-v1536", 96, 288, 3, 4, 2, 1536, family="qwen3", head_dim=40),
    ModelShape("gemma-h160-hd64-kv1", 160, 480, 3, 4, 1, 1200, family="gemma", head_dim=64,
               tie_embeddings=True),
    ModelShape("gemma2-h96-hd64-L4-w24", 96, 256, 4, 2, 1, 1500, family="gemma2", head_dim=64,
               tie_embeddings=True, sliding_window=24, layer_types=(_SW, _FA, _SW, _FA),
               attn_softcap=50.0, final_softcap=30.0),
    ModelShape("gemma3-h160-hd32-L4-w24", 160, 320, 4, 4, 2, 1100, family="gemma3",
               head_dim=32, tie_embeddings=True, sliding_window=24,
               layer_types=(_SW, _SW, _SW, _FA)),
    ModelShape("phi3-h192-L3-w40", 192, 448, 3, 6, 2, 1300, family="phi3", sliding_window=40),
    ModelShape("mixtral-h96-i192-E4k2-L2", 96, 192, 2, 4, 2, 777, family="mixtral",
               experts=4, experts_per_token=2),
    ModelShape("qwen3moe-h160-i80-E6k2", 160, 80, 3, 4, 2, 1001, family="qwen3_moe",
               head_dim=40, experts=6, experts_per_token=2),
)
# the QLoRA paper's recipe (bf16 compute and adapters, paged 32-bit AdamW) and an fp32 one
FAMILY_SETUPS = (
    dict(compute_dtype="bfloat16", quant="nf4", lora_dtype="bfloat16",
         optimizer="paged_adamw", loss_chunk_tokens=32),
    dict(compute_dtype="float32", quant="nf4"),
)

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
    (GQA, dict(compute_dtype="bfloat16", quant="nf4", lora_target_modules=("q_proj", "v_proj"))),
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
    (GQA5, dict(seq_len=96, batch_size=2, checkpoint="every", offload="inputs", mlp_tile=32,
                **_FP32)),
    (GQA5, dict(seq_len=128, offload="all", **_FP32)),
    (MHA48, dict(seq_len=160, batch_size=2, checkpoint="sqrt", offload="inputs", mlp_tile=100,
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


def _families(quick: bool) -> tuple[list[str], float]:
    """The held-out family cases: their table, a worst-error table, the worst total error."""
    lines = ["", "## Every family, held-out shapes", "",
             "Constants fitted on: " + "; ".join(FITTED) + ".", "",
             "Held out (this table): " + ", ".join(s.name for s in HELD_OUT) + "; batch 2 × "
             "48 tokens (longer than every sliding window here), LoRA r=8 on all linears (MoE "
             "experts included). `activations@every` is the peak with every layer recomputed."
             " `total` is the step's tensor bytes (every piece, no checkpointing).", "",
             "| model | setup | piece | predicted | measured | error |",
             "|---|---|---|---:|---:|---:|"]
    worst: dict[tuple[str, str], float] = {}
    worst_total = 0.0
    for shape in HELD_OUT[:2] if quick else HELD_OUT:
        for kw in FAMILY_SETUPS:
            setup = TrainSetup(seq_len=48, batch_size=2, lora_r=8, **kw)
            label = ", ".join(f"{k}={v}" for k, v in kw.items())
            res = compare(shape, setup, ("none", "every"))
            rows = [(p, a, b) for p, a, b in res["none"]]
            rows += [("activations@every", a, b) for p, a, b in res["every"] if p == "activations"]
            pieces = [r for r in res["none"] if r[0] not in ("optim_device", "logits_loss")]
            rows.append(("total", sum(r[1] for r in pieces), sum(r[2] for r in pieces)))
            for piece, pred, meas in rows:
                err = (pred - meas) / meas if meas else 0.0
                key = (shape.family, piece)
                worst[key] = max(worst.get(key, 0.0), abs(err))
                if piece == "total":
                    worst_total = max(worst_total, abs(err))
                lines.append(f"| {shape.name} | {label} | {piece} | {pred} | {meas} "
                             f"| {100 * err:+.2f} % |")
            print(f"done: {shape.name} {label}", flush=True)
    pieces = sorted({p for _, p in worst}, key=lambda p: [r for _, r in worst].index(p))
    families = sorted({f for f, _ in worst}, key=lambda f: [g for g, _ in worst].index(f))
    lines += ["", "Worst |error| per piece and family (held out):", "",
              "| family | " + " | ".join(pieces) + " |", "|---|" + "---:|" * len(pieces)]
    for fam in families:
        cells = [f"{100 * worst[(fam, p)]:.1f} %" if (fam, p) in worst else "" for p in pieces]
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines += ["", f"Worst |error| of a step's total (held out): {100 * worst_total:.2f} %; "
              f"worst of any piece: {100 * max(worst.values()):.1f} %."]
    return lines, worst_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first case only")
    ap.add_argument("--long-context", action="store_true",
                    help="the offload / tiled-MLP setups instead (their own results file)")
    ap.add_argument("--families", action="store_true",
                    help="only the held-out family section")
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
    for shape, kw in [] if args.families else CASES[:1] if args.quick else CASES:
        setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, **kw)
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
    lines += _families(args.quick)[0]
    lines.append(f"\nLoad average at the end: {load_text(os.getloadavg(), digits=1)}.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
