"""Will this fine-tune fit? A table of configurations, each predicted piece by piece.

:func:`plan` takes an architecture (preset or ``config.json``), a device size and a batch,
and evaluates a ladder of configurations from plain bf16 LoRA to the full tightfit stack
(NF4 + double quantization, a budget checkpoint plan, the chunked LM head + loss, the paged
32-bit and 8-bit AdamW) and the long-context ones (every layer recomputed with its input offloaded
to the host, a tiled MLP). Each gets the memory model's bytes per piece on the device, its
bytes on the host, whether both fit (the device with the overhead and the safety margin, the
host within its pinned budget; a row that fits only inside the margin is "tight"), and an
estimated slowdown (:mod:`tightfit.planner.speed`); the fastest that fits with the margin is
recommended, with the ``tightfit train`` options that select it; a configuration the
model's family does not have (:func:`~tightfit.planner.estimate.untiled_mlp`; since every
family's MLP tiles, MoE experts and Phi-3's fused MLP included, none today) is a row
marked not applicable (:attr:`Row.not_applicable`). With
``maximize="seq"`` / ``"batch"`` each configuration instead gets the longest sequence /
largest batch that fits (:mod:`tightfit.planner.max_length`). With ``gpus=N`` every row is
one rank of ``torchrun --nproc_per_node N ... train --fsdp`` (:mod:`tightfit.planner.ranks`),
and the report says the fewest GPUs of the size that fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from tightfit.measure.dtypes import torch_dtype
from tightfit.measure.sizes import format_bytes, parse_bytes
from tightfit.paging.paging_options import DEFAULT_PAGE_BYTES
from tightfit.planner import ranks
from tightfit.planner.estimate import Overhead, estimate, untiled_mlp
from tightfit.planner.host import PINNED_FRACTION, HostLimit, host_limit
from tightfit.planner.max_length import MAX_BATCH, maximize_row
from tightfit.planner.paged_weights import fit_resident_layers
from tightfit.planner.presets import ModelShape, load_shape, model_folder
from tightfit.planner.ranks import MAX_GPUS, RankEstimate, check_gpus, global_batch, step_estimate
from tightfit.planner.speed import DEFAULT_GPU_TFLOPS, DEFAULT_LINK_GBPS, QUANT_SLOWDOWN, slowdown
from tightfit.planner.table import Fewest, PlanReport, Row
from tightfit.planner.train_args import train_args
from tightfit.planner.train_setup import TrainSetup
from tightfit.qlora.prepare_options import LoraOptions

PAGE_BYTES = DEFAULT_PAGE_BYTES  # the paged optimizers' page size
_LORA = LoraOptions()  # tightfit train's and prepare's LoRA defaults are the plan's
# Smallest MLP tile the ladder plans: below it a tile's matmuls (tile × hidden × intermediate)
# get too small to keep a GPU busy (an assumption, like QUANT_SLOWDOWN).
MIN_MLP_TILE = 1024
# The share of the device a recommendation leaves free beyond the overhead: the worst
# held-out |error| of a step's total (5.1 %, a small Mixtral; benchmarks/results/
# plan_accuracy.md: every family on shapes no constant was fitted on), rounded up. The
# recomputed-layer peaks err more (up to +35 %) but only upward, which costs room, not a run.
DEFAULT_MARGIN = 0.06
Maximize = Literal["seq", "batch"]


@dataclass(frozen=True)
class Rung:
    """One configuration of the ladder before it is sized for a step.

    Attributes:
        name: What the table calls it.
        setup: Its pieces (the budgets, loss chunk and MLP tile are sized per step).
        chunked: It runs the chunked LM head + loss.
        tiled: It runs the MLP in tiles.
        paged_weights: It keeps as many layers' NF4 weights on the device as fit and streams
            the others (:func:`~tightfit.planner.paged_weights.fit_resident_layers`).
    """

    name: str
    setup: TrainSetup
    chunked: bool = False
    tiled: bool = False
    paged_weights: bool = False  # as few layers' weights stream as the step needs


@dataclass(frozen=True)
class Sizing:
    """What every configuration is sized against: the device, its overhead, the host, and
    the speed model's throughputs; ``margin`` is the share of the device a fitting row
    leaves free (rows inside it are "tight"); ``gpus``: the rows are one rank of that many
    (every figure, ``gpu_bytes`` and the host budget's share included, is per rank)."""

    shape: ModelShape
    gpu_bytes: int
    overhead: Overhead
    host: HostLimit
    gpu_tflops: float = DEFAULT_GPU_TFLOPS
    link_gbps: float = DEFAULT_LINK_GBPS
    margin: float = 0.0
    gpus: int = 1

    @property
    def margin_bytes(self) -> int:
        return math.ceil(self.margin * self.gpu_bytes)

    @property
    def usable_bytes(self) -> int:
        """The device bytes a row may fill and still fit with the margin."""
        return self.gpu_bytes - self.margin_bytes


def auto_chunk_tokens(shape: ModelShape, setup: TrainSetup, *, monotone: bool = False,
                      activation_budget: int | None = None) -> int:
    """Tokens per loss chunk, by the rule ``tightfit.loss`` uses for ``--loss-chunks auto``.

    ``monotone``: the rule's largest chunk (its 256 MiB cap), not evened out over the
    chunks, so that bytes never fall as the step grows (what the searches of
    :mod:`tightfit.planner.max_length` need); at long sequences the two differ by the evening.
    ``activation_budget``: the step's activation room; a chunk whose working set passes its
    share of it shrinks, as prepare's long-step plan shrinks it
    (:func:`tightfit.checkpoint.long_step.choose_chunk`).
    """
    from tightfit.loss.sizing import BUDGET_SHARE, DEFAULT_MAX_CHUNK_BYTES, chunk_bytes_per_token
    from tightfit.loss.sizing import auto_chunk_tokens as _auto

    dtype = torch_dtype(setup.compute_dtype)
    budget = DEFAULT_MAX_CHUNK_BYTES if monotone else None
    chunk = _auto(shape.vocab, setup.seq_len, setup.batch_size, dtype, budget)
    if activation_budget is None:
        return chunk
    if monotone:  # the shrunk chunk's cap, not evened out: it does not fall as the step grows
        per_token = chunk_bytes_per_token(shape.vocab, dtype)
        return max(1, min(chunk, activation_budget // BUDGET_SHARE // per_token))
    return _auto(shape.vocab, setup.seq_len, setup.batch_size, dtype,
                 activation_budget=activation_budget)


def planned_mlp_tile(shape: ModelShape, setup: TrainSetup) -> int:
    """Tokens per MLP tile, the size to pass to :func:`tightfit.checkpoint.tiling.enable_tiling`.

    ``hidden`` tokens (DeepSpeed/Arctic's TiledMLP bound: one tile's intermediates are the
    size of one MLP weight matrix), all of them when there are fewer, halved while one
    tile's backward still outweighs the attention's (a smaller tile then lowers the layer's
    peak), but not below ``MIN_MLP_TILE`` tokens. A planning rule of the memory model, not
    the tiling module's own ``"auto"``.
    """
    from tightfit.planner.activations import attention_backward_bytes, tiled_mlp_backward_bytes

    tile = max(1, min(shape.hidden, setup.tokens))
    attention = attention_backward_bytes(shape, setup)
    while (tile // 2 >= MIN_MLP_TILE
           and tiled_mlp_backward_bytes(shape, setup, tile) > attention):
        tile //= 2
    return tile


def ladder(base: TrainSetup) -> tuple[Rung, ...]:
    """The configurations :func:`plan` compares, cheapest in memory last of each family."""
    bf16 = base.with_(quant="none", double_quant=False, checkpoint="none",
                      optimizer="adamw", loss_chunk_tokens=None, offload="none", mlp_tile=None)
    nf4 = bf16.with_(quant="nf4", double_quant=False)
    qlora = nf4.with_(double_quant=True)
    budget = qlora.with_(checkpoint="budget", checkpoint_budget=1)
    every_off = qlora.with_(checkpoint="every", offload="inputs")
    return (
        Rung("bf16 LoRA", bf16),
        Rung("bf16 LoRA + ckpt every", bf16.with_(checkpoint="every")),
        Rung("NF4 LoRA", nf4),
        Rung("NF4+DQ LoRA (QLoRA)", qlora),
        Rung("QLoRA + ckpt every", qlora.with_(checkpoint="every")),
        # the QLoRA paper's recipe (with --lora-dtype bfloat16): paged 32-bit AdamW, whose
        # state is fp32 whatever the adapters' dtype (bitsandbytes' paged_adamw_32bit)
        Rung("QLoRA + ckpt every + paged AdamW 32-bit",
             qlora.with_(checkpoint="every", optimizer="paged_adamw")),
        Rung("QLoRA + ckpt budget + chunked loss", budget, chunked=True),
        Rung("full stack (+ paged AdamW 8-bit)", budget.with_(optimizer="paged_adamw8bit"),
             chunked=True),
        # long context: Unsloth's recipe (every layer recomputed, its input on the host)
        Rung("QLoRA + every + offload + chunked loss", every_off, chunked=True),
        Rung("QLoRA + every + offload + chunked + tiled MLP", every_off, chunked=True,
             tiled=True),
        Rung("long-context stack (+ paged AdamW 8-bit)",
             budget.with_(offload="inputs", optimizer="paged_adamw8bit"), chunked=True,
             tiled=True, paged_weights=True),
    )


def _room(gpu: int, overhead: Overhead) -> int:
    """Tensor bytes that fit on the device once the overhead margin is taken."""
    return int((gpu - overhead.fixed_bytes) / (1.0 + overhead.fraction))


def _fit_budgets(shape: ModelShape, setup: TrainSetup, gpu: int, overhead: Overhead,
                 gpus: int = 1) -> TrainSetup:
    """Give a ``budget`` plan the activation room left, a paged optimizer the state room
    (on one rank of ``gpus``: what its shards and gathered blocks leave)."""
    if setup.checkpoint != "budget" and not setup.paged:
        return setup
    probe = step_estimate(shape, setup.with_(checkpoint="every", checkpoint_budget=None,
                                             optimizer_device_budget=None), overhead, gpus)
    static = probe.weights + probe.constants + probe.lora + probe.grads
    if isinstance(probe, RankEstimate):  # held from forward to backward, as the shards
        static += probe.gathered + probe.comm
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


def sized(rung: Rung, sizing: Sizing, seq_len: int, batch: int, *,
          monotone: bool = False) -> TrainSetup:
    """``rung``'s setup for steps of ``batch`` × ``seq_len``: loss chunk, MLP tile, host
    budget, and the checkpoint / optimizer budgets of the room the device leaves. On
    ``sizing.gpus`` > 1, ``batch`` is one rank's rows, the host budget its share (the ranks
    of one machine pin from one RAM), and no layer's weights stream (the base is sharded;
    ``--resident-layers`` is not applied under ``--fsdp``: ``--fsdp-offload`` instead)."""
    shape, gpus, room, over = sizing.shape, sizing.gpus, sizing.usable_bytes, sizing.overhead
    setup = rung.setup.with_(seq_len=seq_len, batch_size=batch,
                             host_budget=sizing.host.budget // gpus)
    if rung.chunked:
        setup = setup.with_(loss_chunk_tokens=auto_chunk_tokens(shape, setup, monotone=monotone))
    if rung.tiled:
        setup = setup.with_(mlp_tile=planned_mlp_tile(shape, setup))
    if rung.paged_weights and gpus == 1:
        def fits(s: TrainSetup) -> bool:
            # the device only: more resident layers leave less on the host, so the most
            # that fit the device is also the placement the host can best hold
            return estimate(shape, _fit_budgets(shape, s, room, over), over).total <= room

        setup = fit_resident_layers(setup, shape.layers, fits)
    fitted = _fit_budgets(shape, setup, room, over, gpus)
    if rung.paged_weights and ranks.needs_host_shards(shape, fitted, room, over, gpus):
        fitted = _fit_budgets(shape, setup.with_(fsdp_offload=True), room, over, gpus)
    if rung.chunked and fitted.checkpoint == "budget" and fitted.checkpoint_budget:
        # a small room shrinks the chunk, as prepare does; the budgets stay (they are room)
        fitted = fitted.with_(loss_chunk_tokens=min(fitted.loss_chunk_tokens, auto_chunk_tokens(
            shape, fitted, monotone=monotone, activation_budget=fitted.checkpoint_budget)))
    return fitted


def evaluate(rung: Rung, sizing: Sizing, setup: TrainSetup) -> Row:
    """The table's row of ``rung`` sized as ``setup``."""
    shape = sizing.shape
    est = step_estimate(shape, setup, sizing.overhead, sizing.gpus)
    slow, paging = slowdown(shape, est, gpu_tflops=sizing.gpu_tflops, link_gbps=sizing.link_gbps)
    fits_device = est.total <= sizing.gpu_bytes
    tight = fits_device and est.fits_host and est.total > sizing.usable_bytes
    args = train_args(setup)
    if sizing.gpus > 1:  # tightfit train's --batch-size is the global batch
        args = train_args(setup.with_(batch_size=setup.batch_size * sizing.gpus))
        if isinstance(est, RankEstimate) and est.sharded:
            args = ("--fsdp", *args)
    return Row(rung.name, setup, est, fits_device and est.fits_host and not tight, slow,
               paging, args, fits_device=fits_device, fits_host=est.fits_host,
               tight=tight)


def plan(
    model: str | Path | ModelShape | dict[str, Any],
    gpu: str | int = "24GiB",
    *,
    seq_len: int = 2048,
    batch_size: int = 1,
    lora_r: int = _LORA.r,
    lora_target_modules: tuple[str, ...] | str = _LORA.target_modules,
    lora_dropout: float = _LORA.dropout,
    lora_dtype: str = _LORA.dtype,
    lora_compute: str = _LORA.compute,
    compute_dtype: str = "bfloat16",
    overhead: str | int = "1GiB",
    slack: float = 0.05,
    margin: float = DEFAULT_MARGIN,
    gpu_tflops: float = DEFAULT_GPU_TFLOPS,
    link_gbps: float = DEFAULT_LINK_GBPS,
    host_ram: str | int | None = None,
    pinned_fraction: float = PINNED_FRACTION,
    maximize: Maximize | None = None,
    granularity: int = 1,
    gpus: int = 1,
) -> PlanReport:
    """Predict whether fine-tuning ``model`` fits on a ``gpu``-sized device, and how.

    The option names are ``tightfit train``'s (``batch_size``, ``lora_target_modules``,
    ``lora_dtype``, ``compute_dtype``), as are :class:`TrainSetup`'s fields.

    Args:
        model: A preset name (``"llama-3.1-8b"``, see ``PRESETS``), a path to an HF
            ``config.json`` (or its folder), a config dict or a :class:`ModelShape`.
        gpu: Device memory, e.g. ``"24GiB"``, ``"80GB"`` or bytes.
        seq_len: Tokens per sequence (with ``maximize="seq"``: unused, it is searched).
        batch_size: Sequences per step (with ``maximize="batch"``: unused, it is searched).
        lora_r: LoRA rank.
        lora_target_modules: ``"all-linear"`` (every projection of the family, MoE experts
            included) or projection names.
        lora_dropout: Dropout on the adapters' input.
        lora_dtype: The adapters' dtype (``"bfloat16"``: the QLoRA paper's scripts).
        lora_compute: What the adapters' matmuls run in: ``"compute_dtype"`` (their
            weights cast to it) or ``"lora_dtype"`` (peft's: the input cast to theirs).
        compute_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (or ``"bf16"``, ...).
        overhead: Fixed device memory that is not tensors (CUDA context, workspaces).
        slack: Allocator slack, a fraction of the tensor bytes.
        margin: Share of the device a recommended row leaves free (default: the worst
            held-out prediction error, :data:`DEFAULT_MARGIN`); rows that fit only inside
            it are "tight", never recommended.
        gpu_tflops: Effective matmul throughput, for the slowdown estimate.
        link_gbps: Host↔device bandwidth in GB/s, for the paging and offload estimate.
        host_ram: Host RAM (e.g. ``"128GiB"``); ``None``: this machine's.
        pinned_fraction: Part of ``host_ram`` offloaded activations and optimizer pages may
            pin (:mod:`tightfit.planner.host`).
        maximize: ``"seq"``: each row at the longest sequence that fits (device and host,
            with the margin), capped by the model's position limit; ``"batch"``: at the
            largest batch.
        granularity: The maximum is a multiple of this many tokens (sequences).
        gpus: GPUs of ``gpu`` size: each row one rank of them on ``batch_size / gpus``
            sequences (the global batch; 1: one a GPU), :mod:`tightfit.planner.ranks`.

    Returns:
        A :class:`PlanReport` (``recommended`` is ``None`` when no row fits with the
        margin); ``str(report)`` is the table ``tightfit plan`` prints.

    Raises:
        ValueError: Unknown preset, malformed config, nonsense sizes or options (``gpus``
            < 1, a batch that does not split over them), a ``seq_len`` beyond the model's
            ``max_position_embeddings``.
    """
    shape = load_shape(model)
    sizing = _sizing(shape, gpu, overhead, slack, margin, gpu_tflops, link_gbps, host_ram,
                     pinned_fraction)
    _check_search(shape, maximize, seq_len, batch_size, granularity)
    sizing = replace(sizing, gpus=check_gpus(gpus))
    batch = global_batch(batch_size, sizing.gpus)
    base = TrainSetup(seq_len=min(seq_len, shape.max_positions), batch_size=batch // sizing.gpus,
                      lora_r=lora_r, lora_target_modules=lora_target_modules,
                      lora_dropout=lora_dropout, lora_dtype=lora_dtype,
                      lora_compute=lora_compute, compute_dtype=compute_dtype)  # type: ignore[arg-type]
    return _report(model, sizing, base, *_rows(ladder(base), sizing, maximize, granularity),
                   maximize, granularity, batch_size)


def _report(model: str | Path | ModelShape | dict[str, Any], sizing: Sizing, base: TrainSetup,
            rows: tuple[Row, ...], best: Row | None, maximize: Maximize | None,
            granularity: int, batch_size: int) -> PlanReport:
    """The :class:`PlanReport` of ``rows``, with the fewest GPUs that fit where asked."""
    gpus = sizing.gpus
    fewest = None
    if maximize is None and (gpus > 1 or best is None):
        fewest = _fewest(base, sizing, batch_size, {gpus: best})
    elif best is None:  # not even the smallest step fits: how many GPUs it would take
        smallest = base.with_(seq_len=min(granularity, base.seq_len)) if maximize == "seq" else base
        fewest = _fewest(smallest, sizing, 1 if maximize == "batch" else batch_size, {})
    notes = _notes(sizing, maximize, granularity)
    if base.batch_size * gpus != batch_size:
        notes += (f"batch: {batch_size} does not split over {gpus} GPUs; planned as one "
                  f"sequence per GPU (--batch-size {gpus})",)
    return PlanReport(sizing.shape, sizing.gpu_bytes, sizing.overhead, rows, best, notes,
                      host=sizing.host, maximize=maximize, granularity=granularity,
                      margin_bytes=sizing.margin_bytes, model_dir=model_folder(model),
                      gpus=gpus, fewest=fewest)


def _fewest(base: TrainSetup, sizing: Sizing, batch_size: int,
            seen: dict[int, Row | None]) -> Fewest:
    """The fewest GPUs of ``sizing``'s size on which some row fits the step (the global
    ``batch_size``; 1: one sequence per GPU). One GPU is tried first (it alone may stream
    base weights to the host); beyond it more GPUs never need more bytes a rank (the shards
    shrink, the rows per rank do not grow), so the counts that split the batch are
    bisected, up to :data:`MAX_GPUS`. ``seen``: counts already planned (their recommended
    row, ``None`` when none fits)."""
    counts = [n for n in range(1, MAX_GPUS + 1) if batch_size == 1 or batch_size % n == 0]

    def best(n: int) -> Row | None:
        if n not in seen:
            per_rank = 1 if batch_size == 1 else batch_size // n
            seen[n] = _rows(ladder(base.with_(batch_size=per_rank)),
                            replace(sizing, gpus=n), None, 1)[1]
        return seen[n]

    if best(1) is not None:
        return Fewest(1, best(1), counts[-1])
    lo, hi = 1, len(counts)  # the first fitting count is in counts[lo:hi], or none
    while lo < hi:
        mid = (lo + hi) // 2
        if best(counts[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(counts):
        return Fewest(0, None, counts[-1])
    return Fewest(counts[lo], best(counts[lo]), counts[-1])


def _rows(rungs: tuple[Rung, ...], sizing: Sizing, maximize: Maximize | None,
          granularity: int) -> tuple[tuple[Row, ...], Row | None]:
    """Every rung's row and the recommended one (``None``: none fits with the margin)."""
    base = rungs[0].setup
    rows = tuple(_row(r, sizing, maximize, base.seq_len, base.batch_size, granularity)
                 for r in rungs)
    # (a row that does not apply has no estimate, and neither fits nor a maximum)
    if maximize is not None:
        fitting = [r for r in rows if r.maximum]
        best = (max(fitting, key=lambda r: (r.maximum, -r.slowdown, -r.estimate.total))
                if fitting else None)
        return rows, best
    fitting = [r for r in rows if r.fits]
    return rows, (min(fitting, key=lambda r: (r.slowdown, r.estimate.total)) if fitting else None)


def _row(rung: Rung, sizing: Sizing, maximize: Maximize | None, seq_len: int, batch: int,
         granularity: int) -> Row:
    """``rung``'s row, maximized under ``maximize``; marked not applicable where the
    model's family has no such configuration (an MLP that cannot be tiled)."""
    why = untiled_mlp(sizing.shape) if rung.tiled else None
    if why is not None:
        setup = rung.setup.with_(seq_len=seq_len, batch_size=batch,
                                 host_budget=sizing.host.budget)
        return Row.inapplicable(rung.name, setup, why)
    if maximize is not None:
        return _maximized(rung, sizing, maximize, seq_len, batch, granularity)
    return evaluate(rung, sizing, sized(rung, sizing, seq_len, batch))


def _check_search(shape: ModelShape, maximize: Maximize | None, seq_len: int, batch: int,
                  granularity: int) -> None:
    if maximize not in (None, "seq", "batch"):
        raise ValueError(f"maximize must be 'seq', 'batch' or None, got {maximize!r}.")
    for name, v in (("seq_len", seq_len), ("batch_size", batch), ("granularity", granularity)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    if maximize != "seq" and seq_len > shape.max_positions:
        raise ValueError(
            f"seq_len {seq_len} is longer than {shape.name} supports "
            f"(max_position_embeddings={shape.max_positions}); pass a shorter --seq-len."
        )


def _maximized(rung: Rung, sizing: Sizing, maximize: Maximize, seq_len: int, batch: int,
               granularity: int) -> Row:
    """``rung`` at the longest sequence (at ``batch``) / largest batch (at ``seq_len``)."""
    gpus = sizing.gpus

    def row_at(n: int) -> Row:  # n: tokens, or the global batch (a multiple of gpus)
        s, b = (n, batch) if maximize == "seq" else (seq_len, n // gpus)
        return evaluate(rung, sizing, sized(rung, sizing, s, b, monotone=True))

    if maximize == "seq":
        return maximize_row(row_at, cap=sizing.shape.max_positions, granularity=granularity,
                            what=maximize)
    # the global batch splits over the ranks: a multiple of gpus too
    step = math.lcm(granularity, gpus)
    return maximize_row(row_at, cap=MAX_BATCH // step * step, granularity=step, what=maximize)


def _sizing(shape: ModelShape, gpu: str | int, overhead: str | int, slack: float,
            margin: float, gpu_tflops: float, link_gbps: float, host_ram: str | int | None,
            pinned_fraction: float) -> Sizing:
    gpu_bytes = parse_bytes(gpu, what="gpu")
    if gpu_bytes < 2**20:
        raise ValueError(
            f"gpu: {gpu!r} is {gpu_bytes} bytes, too small to be a device; a bare number is "
            "bytes, so write the unit, e.g. '24GiB'."
        )
    fixed = 0 if overhead in (0, "0") else parse_bytes(overhead, what="overhead")
    if gpu_tflops <= 0 or link_gbps <= 0:
        raise ValueError("gpu_tflops and link_gbps must be positive.")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.5:
        raise ValueError(f"margin must be a share of the device in [0, 0.5), e.g. 0.08 for "
                         f"8 %, got {margin!r}.")
    return Sizing(shape, gpu_bytes, Overhead(fixed_bytes=fixed, fraction=slack),
                  host_limit(host_ram, pinned_fraction), gpu_tflops, link_gbps, float(margin))


def _notes(sizing: Sizing, maximize: Maximize | None, granularity: int) -> tuple[str, ...]:
    margin = sizing.overhead
    notes = [
        f"slowdown: estimated, relative to bf16 LoRA without checkpointing; NF4 matmuls x"
        f"{QUANT_SLOWDOWN['nf4']}, recompute from the plan (a frozen-base step = 2 forwards), "
        f"paging and offload over {sizing.link_gbps:g} GB/s against {sizing.gpu_tflops:g} "
        "TFLOP/s of compute (offload counts only what the compute beside it does not hide)",
        f"overhead: {format_bytes(margin.fixed_bytes)} fixed + {100 * margin.fraction:g}% "
        "allocator slack",
        f"margin: {100 * sizing.margin:g}% of the device ({format_bytes(sizing.margin_bytes)})"
        " kept free beyond the overhead"
        + (" (the worst held-out error of a step's predicted total, benchmarks/results/"
           "plan_accuracy.md)" if sizing.margin == DEFAULT_MARGIN else "")
        + "; a row that fits only inside it is 'tight', never recommended",
        sizing.host.describe(),
    ]
    if maximize is not None:
        what = "sequence" if maximize == "seq" else "batch"
        unit = "tokens" if maximize == "seq" else "sequences"
        notes.append(f"max {maximize}: the longest {what} each configuration fits (device and "
                     f"host), searched to {granularity} {unit}; its pieces are at that size"
                     + ("; capped by the model's max_position_embeddings"
                        f"={sizing.shape.max_positions}" if maximize == "seq" else ""))
    return tuple(notes)
