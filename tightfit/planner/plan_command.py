"""Will this fine-tune fit? Predict every piece of device memory, then recommend a setup.

Examples::

    tightfit plan --model llama-2-7b --gpu 24GiB --seq-len 2048
    tightfit plan --model path/to/config.json --gpu 80GB --batch-size 4 --json
    tightfit plan --model llama-65b --gpu 48GB --seq-len 512 --lora-r 64 --lora-dtype bf16
    tightfit plan --model tiny.json --gpu 256MiB --seq-len 128 --verify
    tightfit plan --model llama-3.1-8b --gpu 24GiB --lora-r 32 --max-seq --host-ram 128GiB
    tightfit plan --model llama-3.3-70b --gpu 24GiB --gpus 3 --seq-len 2048

``--verify`` (small configs only) runs one real step of every configuration on this
machine and prints predicted vs measured bytes per piece. ``--max-seq`` (``--max-batch``)
answers "how long can my sequences be": each configuration at the longest sequence (largest
batch) that fits the device and the host.

Reading the table: one row per configuration, its device bytes piece by piece (``total``
is what must fit ``--gpu``) and ``host``, what it keeps in pinned host memory (offloaded
layer inputs + paged optimizer state; must fit ``--pinned-fraction`` of ``--host-ram``).
``fits``: yes (with the safety margin ``--margin`` left free), tight (only inside the
margin: never recommended), NO (device), HOST (the device fits, the host does not) or n/a. The
exit code is 1 when no row fits with the margin. With ``--gpus N`` each row is one rank of
``torchrun --nproc_per_node N -m tightfit.cli train --fsdp``: its shards, the blocks gathered in
flight (``gather``), the collectives' buffers (``comm``) and its own rows' activations; a
line says the fewest GPUs of ``--gpu`` size that fit (also on one GPU when nothing fits). With ``--max-seq``
the first column is each row's longest sequence and its pieces are at that length; the note
line under the table says what binds (device, host, or the model's position limit).

Row 6 is the QLoRA paper's recipe (with ``--lora-dtype bfloat16``): every layer recomputed
and the paged 32-bit AdamW (fp32 state whatever the adapters' dtype). Rows 9-11 are for
long sequences: every layer recomputed with its input offloaded to pinned
host memory (brought back one layer ahead) and the chunked loss — Unsloth's recipe —; the
same with the MLP run in tiles of tokens; and a budget plan with both and the paged 8-bit
AdamW. Offload costs host RAM and link time (hidden behind compute when it can be), the tiled
MLP one more MLP forward per layer. See docs/plan.md, "Long context". A row that does not apply
to the model's family (the tiled MLP of Phi-3's fused MLP or of MoE experts) reads ``n/a``,
with the reason on its note line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re

from tightfit.measure.dtypes import DTYPE_NAMES, SHORT_NAMES
from tightfit.planner.shapes import KNOWN_WEIGHTS
from tightfit.qlora.lora_compute import LORA_COMPUTES

_VERIFY_MAX_PARAMS = 60_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tightfit plan``; each default is :func:`tightfit.plan`'s (whose LoRA
    defaults are :class:`~tightfit.LoraOptions`', tightfit train's)."""
    from tightfit.planner.ladder import DEFAULT_MARGIN, plan
    from tightfit.planner.presets import PRESETS

    d = {k: p.default for k, p in inspect.signature(plan).parameters.items()}
    targets = d["lora_target_modules"]
    targets = targets if isinstance(targets, str) else ",".join(targets)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    # let "--gpu -3GB" reach parse_bytes (which explains the error) instead of argparse
    # taking "-3GB" for an option
    parser._negative_number_matcher = re.compile(r"^-\d*\.?\d+[A-Za-z]*$")
    parser.add_argument("--model", required=True, metavar="CONFIG|PRESET",
                        help="an HF config.json (or its folder) or a preset: " + ", ".join(PRESETS))
    parser.add_argument("--gpu", default=d["gpu"], metavar="SIZE",
                        help=f"device memory, e.g. 24GiB, 80GB (default: {d['gpu']})")
    parser.add_argument("--seq-len", type=int, default=d["seq_len"],
                        help=f"tokens per sequence (default: {d['seq_len']})")
    dtypes = [*DTYPE_NAMES, *SHORT_NAMES]
    # tightfit train's names and LoRA defaults
    parser.add_argument("--batch-size", type=int, default=d["batch_size"],
                        help=f"sequences per step (default: {d['batch_size']})")
    parser.add_argument("--lora-r", type=int, default=d["lora_r"],
                        help=f"LoRA rank (default: {d['lora_r']})")
    parser.add_argument("--lora-target-modules", default=targets,
                        help="comma-separated projection names or all-linear (default: every "
                        "projection of the family, MoE experts included)")
    parser.add_argument("--lora-dropout", type=float, default=d["lora_dropout"],
                        help=f"dropout on the adapters' input (default: {d['lora_dropout']:g})")
    parser.add_argument("--lora-dtype", default=d["lora_dtype"], choices=dtypes,
                        help="dtype of the adapters: float32 (peft's default) or bfloat16 as the "
                        f"QLoRA paper's scripts (default: {d['lora_dtype']})")
    parser.add_argument("--lora-compute", default=d["lora_compute"],
                        choices=LORA_COMPUTES,
                        help="what the adapters' matmuls run in: compute_dtype (their weights "
                        "cast to it: no copy of their inputs saved) or lora_dtype (peft's: each "
                        f"input cast to the adapters' dtype and saved) (default: "
                        f"{d['lora_compute']})")
    parser.add_argument("--compute-dtype", default=d["compute_dtype"], choices=dtypes,
                        help="compute dtype; the short forms bf16, fp16, fp32 also work "
                        f"(default: {d['compute_dtype']})")
    parser.add_argument("--margin", type=float, default=None, metavar="SHARE",
                        help="share of the device a recommended row leaves free; rows inside it "
                        f"are 'tight' (default: {DEFAULT_MARGIN:g}, the worst held-out error of "
                        "a predicted total)")
    parser.add_argument("--overhead", default=d["overhead"], metavar="SIZE",
                        help="fixed non-tensor device memory: CUDA context, workspaces "
                        f"(default: {d['overhead']})")
    parser.add_argument("--slack", type=float, default=d["slack"],
                        help=f"allocator slack as a fraction of tensor bytes (default: "
                        f"{d['slack']:g})")
    parser.add_argument("--gpu-tflops", type=float, default=d["gpu_tflops"],
                        help=f"effective TFLOP/s, for the slowdown estimate (default: "
                        f"{d['gpu_tflops']:g})")
    parser.add_argument("--link-gbps", type=float, default=d["link_gbps"],
                        help="host<->device GB/s, for the paging and offload slowdown estimate "
                        f"(default: {d['link_gbps']:g})")
    parser.add_argument("--host-ram", default=d["host_ram"], metavar="SIZE",
                        help="host RAM offloaded activations and optimizer pages are checked "
                        "against (default: this machine's RAM)")
    parser.add_argument("--pinned-fraction", type=float, default=d["pinned_fraction"],
                        help="part of --host-ram that may be pinned for them (default: "
                        f"{d['pinned_fraction']:g})")
    most = parser.add_mutually_exclusive_group()
    most.add_argument("--max-seq", action="store_true",
                      help="for each configuration, the longest sequence (at --batch-size) that "
                      "fits the GPU and the host, capped by the model's position limit")
    most.add_argument("--max-batch", action="store_true",
                      help="for each configuration, the largest batch (at --seq-len) that fits")
    parser.add_argument("--granularity", type=int, default=d["granularity"],
                        help="with --max-seq/--max-batch: search to a multiple of this many "
                        f"tokens/sequences (default: {d['granularity']})")
    parser.add_argument("--gpus", type=int, default=d["gpus"], metavar="N",
                        help="GPUs of --gpu size (torchrun --nproc_per_node N ... train --fsdp): "
                        "every figure is one rank's, on --batch-size / N sequences (the global "
                        "batch, as tightfit train's; 1 on N GPUs: one a GPU), and the fewest "
                        f"GPUs that fit is said (default: {d['gpus']})")
    _add_output(parser)


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--verify", action="store_true",
                        help="small configs only: run one real step of each configuration on "
                        "this machine and print predicted vs measured bytes per piece")


def _targets(text: str) -> tuple[str, ...] | str:
    if text.strip() in ("", "all-linear"):
        return "all-linear"
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in KNOWN_WEIGHTS]
    if bad:
        raise ValueError(f"--lora-target-modules: unknown {bad}; choose from "
                         f"{', '.join(KNOWN_WEIGHTS)} or all-linear.")
    return names


def run(args: argparse.Namespace) -> int:
    """``tightfit plan``: print the table (or JSON), optionally verified.

    Returns:
        0 when a configuration is recommended, 1 when none fits with the margin.
    """
    from tightfit.planner.ladder import DEFAULT_MARGIN, plan

    if args.verify and args.gpus != 1:
        raise ValueError(
            f"--verify runs every configuration in this one process, not as {args.gpus} ranks; "
            "drop --gpus to verify the one-GPU rows (a rank's base is measured by "
            "benchmarks/fsdp_qlora.py under torchrun)."
        )
    report = plan(
        args.model, args.gpu, seq_len=args.seq_len, batch_size=args.batch_size,
        lora_r=args.lora_r, lora_target_modules=_targets(args.lora_target_modules),
        lora_dropout=args.lora_dropout, lora_dtype=args.lora_dtype,
        lora_compute=args.lora_compute, compute_dtype=args.compute_dtype,
        margin=DEFAULT_MARGIN if args.margin is None else args.margin,
        overhead=args.overhead, slack=args.slack, gpu_tflops=args.gpu_tflops,
        link_gbps=args.link_gbps, host_ram=args.host_ram, pinned_fraction=args.pinned_fraction,
        maximize="seq" if args.max_seq else "batch" if args.max_batch else None,
        granularity=args.granularity, gpus=args.gpus,
    )
    if args.verify and report.shape.num_params() > _VERIFY_MAX_PARAMS:
        raise ValueError(
            f"--verify runs every configuration for real on this machine; {report.shape.name} "
            f"has {report.shape.num_params() / 1e6:.0f} M parameters (limit "
            f"{_VERIFY_MAX_PARAMS / 1e6:.0f} M). Pass a small config.json of the same family."
        )
    verified = None
    if args.verify:
        from tightfit.planner.verify import verify_report

        verified = verify_report(report)
    if args.json:
        out = report.to_dict()
        if verified is not None:
            out["verify"] = verified
        print(json.dumps(out, indent=2))
        return 0 if report.recommended is not None else 1
    print(report)
    if verified is not None:
        from tightfit.planner.verify import format_verify

        print()
        print(format_verify(verified))
    return 0 if report.recommended is not None else 1
