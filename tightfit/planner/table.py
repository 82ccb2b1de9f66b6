"""The ladder's answer (:class:`PlanReport`, one :class:`Row` per configuration) and the table
``tightfit plan`` prints of it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from tightfit.measure.sizes import format_bytes
from tightfit.planner.estimate import Estimate, Overhead
from tightfit.planner.presets import ModelShape
from tightfit.planner.setup import TrainSetup


@dataclass(frozen=True)
class Row:
    """One configuration of the plan."""

    name: str
    setup: TrainSetup
    estimate: Estimate
    fits: bool
    slowdown: float
    paging_bytes_per_step: int
    train_args: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "name": self.name,
            "fits": self.fits,
            "total_bytes": e.total,
            "pieces_bytes": e.pieces(),
            "optimizer_offloaded_bytes": e.optimizer_offloaded,
            "paging_bytes_per_step": self.paging_bytes_per_step,
            "slowdown": round(self.slowdown, 3),
            "recompute_fraction": round(e.recompute_fraction, 4),
            # [start, stop, checkpointed] per segment (docs/plan.md)
            "checkpoint_segments": [[s.start, s.stop, s.kind == "checkpoint"]
                                    for s in e.segments],
            "setup": {k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in vars(self.setup).items()},
            "train_args": list(self.train_args),
        }


@dataclass(frozen=True)
class PlanReport:
    """The answer of :func:`plan`: every configuration, and the one to use."""

    shape: ModelShape
    gpu_bytes: int
    overhead: Overhead
    rows: tuple[Row, ...]
    recommended: Row | None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": vars(self.shape),
            "params": self.shape.num_params(),
            "gpu_bytes": self.gpu_bytes,
            "overhead": {"fixed_bytes": self.overhead.fixed_bytes,
                         "fraction": self.overhead.fraction},
            "rows": [r.to_dict() for r in self.rows],
            "recommended": None if self.recommended is None else self.recommended.name,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        return render(self)


_COLUMNS = (
    ("weights", "weights"),
    ("consts", "constants"),
    ("LoRA", "lora"),
    ("grads", "grads"),
    ("optim", "optimizer"),
    ("activ", "activations"),
    ("logits", "logits_loss"),
    ("overhd", "overhead"),
)


def _unit(gpu_bytes: int) -> tuple[str, int]:
    """Print GiB for real devices, MiB (or KiB) for the small ones ``--verify`` runs."""
    if gpu_bytes >= 4 * 1024**3:
        return "GiB", 1024**3
    if gpu_bytes >= 4 * 1024**2:
        return "MiB", 1024**2
    return "KiB", 1024


def render(report: PlanReport) -> str:
    """The plan as text: model line, per-configuration table (GiB), recommendation."""
    s = report.shape
    rows = report.rows
    setup = rows[0].setup if rows else None
    lines = [
        f"model {s.name}: {s.num_params() / 1e9:.2f} B params, {s.layers} layers, hidden "
        f"{s.hidden}, intermediate {s.intermediate}, heads {s.heads}/{s.kv_heads} kv, vocab "
        f"{s.vocab}{', tied embeddings' if s.tie_embeddings else ''}",
    ]
    if setup is not None:
        lines.append(
            f"step: batch {setup.batch} x {setup.seq_len} tokens, {setup.compute_dtype} compute, "
            f"LoRA r={setup.lora_r} on {len(setup.lora_targets)} linears/layer "
            f"({setup.adapter_dtype} adapters), AdamW"
        )
    unit, scale = _unit(report.gpu_bytes)
    lines.append(f"device: {format_bytes(report.gpu_bytes)}   (sizes below in {unit})")
    lines.append("")
    name_w = max([len(r.name) for r in rows] + [13]) + 1
    header = f"{'#':>2} {'configuration':<{name_w}}" + "".join(f"{c:>8}" for c, _ in _COLUMNS)
    header += f"{'total':>8}  {'fits':<4} {'slowdown':>8}"
    lines += [header, "-" * len(header)]
    for i, r in enumerate(rows, 1):
        p = r.estimate.pieces()
        mark = "*" if r is report.recommended else " "
        line = f"{i:>2}{mark}{r.name:<{name_w}}"
        line += "".join(f"{p[k] / scale:>8.2f}" for _, k in _COLUMNS)
        line += f"{r.estimate.total / scale:>8.2f}  {'yes' if r.fits else 'NO':<4} {r.slowdown:>7.2f}x"
        lines.append(line)
    lines.append("")
    for i, r in enumerate(rows, 1):
        e = r.estimate
        extra = []
        if e.segments and r.setup.checkpoint != "none":
            ck = [seg for seg in e.segments if seg.kind == "checkpoint"]
            extra.append(f"checkpoint {r.setup.checkpoint}: {sum(map(len, ck))}/{s.layers} "
                         f"layers recomputed in {len(ck)} segments")
        if r.setup.loss_chunk_tokens:
            extra.append(f"loss in chunks of {r.setup.loss_chunk_tokens} tokens")
        if e.optimizer_offloaded:
            extra.append(f"optimizer {format_bytes(e.optimizer_offloaded)} on the host, "
                         f"{format_bytes(r.paging_bytes_per_step)}/step paged")
        if extra:
            lines.append(f"{i:>2}: " + "; ".join(extra))
    lines.append("")
    if report.recommended is None:
        smallest = min(rows, key=lambda r: r.estimate.total)
        lines.append(
            f"nothing fits: the smallest configuration ({smallest.name}) needs "
            f"{format_bytes(smallest.estimate.total)} of {format_bytes(report.gpu_bytes)}; "
            "try a shorter --seq-len, a smaller --batch or a larger --gpu."
        )
    else:
        r = report.recommended
        headroom = report.gpu_bytes - r.estimate.total
        lines.append(f"recommended: #{rows.index(r) + 1} {r.name} — "
                     f"{format_bytes(r.estimate.total)} predicted, "
                     f"{format_bytes(headroom)} to spare, ~{r.slowdown:.2f}x step time")
        lines.append("  tightfit train --model DIR " + " ".join(shlex.quote(a) for a in r.train_args))
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
