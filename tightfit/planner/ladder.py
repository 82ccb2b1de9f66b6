"""Will this fine-tune fit? A table of configurations, each predicted piece by piece.

:func:`plan` takes an architecture (preset or ``config.json``), a device size and a batch,
and evaluates a ladder of configurations from plain bf16 LoRA to the full tightfit stack
(NF4 + double quantization, a budget checkpoint plan, the chunked LM head + loss, a paged
8-bit optimizer). Each gets the memory model's bytes per piece, whether it fits with the
overhead margin, and an estimated slowdown; the fastest that fits is recommended, with the
``tightfit train`` options that select it.

The slowdown is an estimate, not a measurement: recompute is counted from the plan (a
frozen-base LoRA step costs ≈ 2 forwards, so recomputing every layer adds ≈ 50 %), NF4/int8
matmuls cost ``QUANT_SLOWDOWN`` × the 16-bit ones, and paging moves the host-resident
optimizer state twice per step over a ``link_gbps`` link against a step whose compute
time is its FLOPs at ``gpu_tflops``.
"""

from __future__ import annotations

from pathlib import Path

from tightfit.measure.dtypes import torch_dtype
from tightfit.measure.sizes import format_bytes, parse_bytes
from tightfit.optim.base import DEFAULT_PAGE_BYTES
from tightfit.planner.estimate import Estimate, Overhead, estimate
from tightfit.planner.presets import ModelShape, load_shape
from tightfit.planner.setup import TrainSetup
from tightfit.planner.table import PlanReport, Row
from tightfit.planner.train_args import train_args

# Assumed cost ratios (see module doc); stated in every printed plan.
QUANT_SLOWDOWN = {"none": 1.0, "nf4": 1.15, "int8": 1.3}
DEFAULT_LINK_GBPS = 20.0  # host <-> device, PCIe 4.0 x16 in practice
DEFAULT_GPU_TFLOPS = 100.0  # effective bf16 matmul throughput of a training step
PAGE_BYTES = DEFAULT_PAGE_BYTES  # the paged optimizers' page size


def _flops_per_step(shape: ModelShape, setup: TrainSetup) -> float:
    """Matmul FLOPs of one frozen-base LoRA step (forward + input-gradient backward)."""
    layer = sum(fi * fo for fi, fo in shape.linear_shapes().values())
    weights = shape.layers * layer + shape.vocab * shape.hidden
    attn = 4 * setup.seq_len * shape.q_size * shape.layers  # QK^T and PV, per token
    return 2 * 2 * setup.tokens * (weights + attn)


def slowdown(shape: ModelShape, est: Estimate, *, gpu_tflops: float = DEFAULT_GPU_TFLOPS,
             link_gbps: float = DEFAULT_LINK_GBPS) -> tuple[float, int]:
    """``(step time ÷ plain bf16 LoRA step time, paging bytes per step)`` — an estimate."""
    setup = est.setup
    compute = QUANT_SLOWDOWN[setup.quant] * (1.0 + est.recompute_fraction)
    paging = 2 * est.optimizer_offloaded
    step_s = _flops_per_step(shape, setup) / (gpu_tflops * 1e12)
    return compute + (paging / (link_gbps * 1e9)) / step_s, paging


def auto_chunk_tokens(shape: ModelShape, setup: TrainSetup) -> int:
    """Tokens per loss chunk, by the rule ``tightfit.loss`` uses for ``--loss-chunks auto``."""
    from tightfit.loss.sizing import auto_chunk_tokens as _auto

    return _auto(shape.vocab, setup.seq_len, setup.batch, torch_dtype(setup.compute_dtype))


def _ladder(base: TrainSetup, shape: ModelShape) -> list[tuple[str, TrainSetup]]:
    bf16 = base.with_(quant="none", double_quant=False, checkpoint="none",
                      optimizer="adamw", loss_chunk_tokens=None)
    nf4 = bf16.with_(quant="nf4", double_quant=False)
    qlora = nf4.with_(double_quant=True)
    chunk = auto_chunk_tokens(shape, base)
    return [
        ("bf16 LoRA", bf16),
        ("bf16 LoRA + ckpt every", bf16.with_(checkpoint="every")),
        ("NF4 LoRA", nf4),
        ("NF4+DQ LoRA (QLoRA)", qlora),
        ("QLoRA + ckpt every", qlora.with_(checkpoint="every")),
        ("QLoRA + ckpt budget + chunked loss",
         qlora.with_(checkpoint="budget", checkpoint_budget=1, loss_chunk_tokens=chunk)),
        ("full stack (+ paged AdamW 8-bit)",
         qlora.with_(checkpoint="budget", checkpoint_budget=1, loss_chunk_tokens=chunk, optimizer="paged_adamw8bit")),
    ]


def _room(gpu: int, overhead: Overhead) -> int:
    """Tensor bytes that fit on the device once the overhead margin is taken."""
    return int((gpu - overhead.fixed_bytes) / (1.0 + overhead.fraction))


def _fit_budgets(shape: ModelShape, setup: TrainSetup, gpu: int, overhead: Overhead) -> TrainSetup:
    """Give a ``budget`` plan the activation room left, a paged optimizer the state room."""
    if setup.checkpoint != "budget" and not setup.paged:
        return setup
    probe = estimate(shape, setup.with_(checkpoint="every", checkpoint_budget=None,
                                        optimizer_device_budget=None), overhead)
    static = probe.weights + probe.constants + probe.lora + probe.grads
    room = _room(gpu, overhead) - static
    if setup.paged:
        # keep resident what is left beside the smallest activation plan; the rest pages
        # through the optimizer's streaming window. Budgets are whole pages, at least one.
        spare = room - probe.activation_peak
        if spare >= probe.optimizer:
            resident = probe.optimizer
            setup = setup.with_(optimizer_device_budget=None)
        else:
            resident = max(PAGE_BYTES, spare // PAGE_BYTES * PAGE_BYTES)
            setup = setup.with_(optimizer_device_budget=resident)
        room -= resident
    else:
        room -= probe.optimizer
    if setup.checkpoint == "budget":
        setup = setup.with_(checkpoint_budget=max(1, room))
    return setup


def plan(
    model: str | Path | ModelShape | dict,
    gpu: str | int = "24GiB",
    *,
    seq_len: int = 2048,
    batch: int = 1,
    lora_r: int = 16,
    lora_targets: tuple[str, ...] | None = None,
    compute_dtype: str = "bfloat16",
    overhead: str | int = "1GiB",
    slack: float = 0.05,
    gpu_tflops: float = DEFAULT_GPU_TFLOPS,
    link_gbps: float = DEFAULT_LINK_GBPS,
) -> PlanReport:
    """Predict whether fine-tuning ``model`` fits on a ``gpu``-sized device, and how.

    Args:
        model: A preset name (``"llama-2-7b"``, see ``PRESETS``), a path to an HF
            ``config.json`` (or its folder), a config dict or a :class:`ModelShape`.
        gpu: Device memory, e.g. ``"24GiB"``, ``"80GB"`` or bytes.
        seq_len: Tokens per sequence.
        batch: Sequences per step.
        lora_r: LoRA rank.
        lora_targets: Linear layers that get adapters (default: all seven).
        compute_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (or ``"bf16"``,
            ``"fp16"``, ``"fp32"``).
        overhead: Fixed device memory that is not tensors (CUDA context, workspaces).
        slack: Allocator slack, a fraction of the tensor bytes.
        gpu_tflops: Effective matmul throughput, for the paging slowdown estimate.
        link_gbps: Host↔device bandwidth in GB/s, for the paging slowdown estimate.

    Returns:
        A :class:`PlanReport`; ``str(report)`` is the table ``tightfit plan`` prints.

    Raises:
        ValueError: Unknown preset, malformed config, nonsense sizes or options.
    """
    shape = load_shape(model)
    gpu_bytes = parse_bytes(gpu, what="gpu")
    if gpu_bytes < 2**20:
        raise ValueError(
            f"gpu: {gpu!r} is {gpu_bytes} bytes, too small to be a device; a bare number is "
            "bytes, so write the unit, e.g. '24GiB'."
        )
    fixed = 0 if overhead in (0, "0") else parse_bytes(overhead, what="overhead")
    margin = Overhead(fixed_bytes=fixed, fraction=slack)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}.")
    if seq_len > shape.max_positions:
        raise ValueError(
            f"seq_len {seq_len} is longer than {shape.name} supports "
            f"(max_position_embeddings={shape.max_positions}); pass a shorter --seq-len."
        )
    if gpu_tflops <= 0 or link_gbps <= 0:
        raise ValueError("gpu_tflops and link_gbps must be positive.")
    base = TrainSetup(seq_len=seq_len, batch=batch, lora_r=lora_r, compute_dtype=compute_dtype,
                      **({"lora_targets": tuple(lora_targets)} if lora_targets else {}))
    rows: list[Row] = []
    for name, setup in _ladder(base, shape):
        setup = _fit_budgets(shape, setup, gpu_bytes, margin)
        est = estimate(shape, setup, margin)
        slow, paging = slowdown(shape, est, gpu_tflops=gpu_tflops, link_gbps=link_gbps)
        rows.append(Row(name, setup, est, est.total <= gpu_bytes, slow, paging,
                        train_args(setup)))
    fitting = [r for r in rows if r.fits]
    best = min(fitting, key=lambda r: (r.slowdown, r.estimate.total)) if fitting else None
    notes = (
        f"slowdown: estimated, relative to bf16 LoRA without checkpointing; NF4 matmuls x"
        f"{QUANT_SLOWDOWN['nf4']}, recompute from the plan (a frozen-base step = 2 forwards), "
        f"paging over {link_gbps:g} GB/s against {gpu_tflops:g} TFLOP/s of compute",
        f"overhead: {format_bytes(margin.fixed_bytes)} fixed + {100 * slack:g}% allocator slack",
    )
    return PlanReport(shape, gpu_bytes, margin, tuple(rows), best, notes)
