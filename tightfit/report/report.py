"""The per-piece memory report: what each piece of the QLoRA stack saved, measured.

One row per piece, as in the design's table "piece -> memory pain it targets", each with the
bytes *without* the piece (full fine-tuning in bf16, fp32 absmax, no checkpointing, ...) and
*with* it, counted from the prepared model's real tensors and measured on the real batch
(see :mod:`tightfit.report.pieces`). Rendered as a text table, JSON, Markdown and a PNG bars.

Example::

    report = measure_report(model, batch, optimizer=opt)
    print(report.table())
    report.save("out/")          # report.json, report.md, memory_report.png
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit.report import pieces

MiB = 1 << 20


@dataclass(frozen=True)
class Piece:
    """One row of the report.

    Attributes:
        name: The piece ("base weights", "quantization constants", ...).
        pain: The memory pain it targets.
        without: What the bytes would be without the piece (label, e.g. "bf16").
        without_bytes: Bytes without the piece.
        with_: What the piece turns it into (label, e.g. "NF4").
        with_bytes: Bytes with the piece, measured.
        detail: Extra measured figures (bits per parameter, per-tier bytes, ...).
    """

    name: str
    pain: str
    without: str
    without_bytes: int
    with_: str
    with_bytes: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        return self.without_bytes - self.with_bytes

    @property
    def ratio(self) -> float:
        return self.with_bytes / self.without_bytes if self.without_bytes else 1.0


@dataclass
class MemoryReport:
    """The measured per-piece report, plus what it was measured on."""

    pieces: list[Piece]
    meta: dict[str, Any] = field(default_factory=dict)

    def piece(self, name: str) -> Piece:
        """The row called ``name``."""
        for p in self.pieces:
            if p.name == name:
                return p
        raise KeyError(f"no piece {name!r}; pieces are {[p.name for p in self.pieces]}")

    # -- rendering -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        rows = []
        for p in self.pieces:
            d = asdict(p)
            d["with"] = d.pop("with_")
            d["saved_bytes"] = p.saved_bytes
            rows.append(d)
        return {"meta": self.meta, "pieces": rows}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def _rows(self) -> list[list[str]]:
        out = []
        for p in self.pieces:
            out.append([
                p.name, p.pain,
                f"{p.without} {p.without_bytes / MiB:.2f} MiB",
                f"{p.with_} {p.with_bytes / MiB:.2f} MiB",
                f"{p.ratio:.3f}",
            ])
        return out

    _HEAD = ["piece", "memory pain it targets", "without", "with (measured)", "with/without"]

    def table(self) -> str:
        """A plain-text table for the terminal."""
        rows = [self._HEAD, *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEAD))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines += self._detail_lines()
        return "\n".join(lines)

    def _detail_lines(self) -> list[str]:
        lines = []
        for p in self.pieces:
            if p.detail:
                shown = ", ".join(f"{k}={_fmt(v)}" for k, v in p.detail.items())
                lines.append(f"  {p.name}: {shown}")
        return lines

    def to_markdown(self) -> str:
        """The report as a Markdown document."""
        lines = ["# tightfit memory report", ""]
        if self.meta:
            lines += [f"- {k}: {_fmt(v)}" for k, v in self.meta.items()] + [""]
        lines.append("| " + " | ".join(self._HEAD) + " |")
        lines.append("|" + "---|" * len(self._HEAD))
        lines += ["| " + " | ".join(r) + " |" for r in self._rows()]
        lines += ["", "Details (measured):", ""]
        lines += [f"- {line.strip()}" for line in self._detail_lines()]
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Bar chart (MiB, without vs with per piece) saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [p.name for p in self.pieces]
        x = range(len(names))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.bar([i - 0.2 for i in x], [p.without_bytes / MiB for p in self.pieces], 0.4,
               label="without the piece", color="#bbbbbb")
        ax.bar([i + 0.2 for i in x], [p.with_bytes / MiB for p in self.pieces], 0.4,
               label="with (measured)", color="#2b7bba")
        ax.set_xticks(list(x), names, rotation=20, ha="right")
        ax.set_ylabel("MiB")
        ax.set_yscale("log")
        for i, p in enumerate(self.pieces):
            ax.annotate(f"{p.ratio:.2f}x", (i + 0.2, max(p.with_bytes / MiB, 1e-6)),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title("tightfit: memory per piece, without vs with")
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def save(self, folder: str | os.PathLike[str]) -> dict[str, Path]:
        """Write ``report.json``, ``report.md`` and ``memory_report.png`` into ``folder``."""
        d = Path(folder)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"json": d / "report.json", "md": d / "report.md", "png": d / "memory_report.png"}
        _atomic_write(paths["json"], self.to_json())
        _atomic_write(paths["md"], self.to_markdown())
        self.plot(paths["png"])
        return paths


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Optimizer state bytes, and bytes per tier.

    A paged optimizer's ``memory_stats()``: ``state`` is its pages' bytes; ``device`` also
    holds the streaming window's buffers, so the tiers add up to more than the state when it
    pages. Any other optimizer: its state tensors counted, all on the device tier.
    """
    stats = getattr(optimizer, "memory_stats", None)
    if callable(stats):
        s = stats()
        get = s.get if isinstance(s, Mapping) else lambda k, d=0: getattr(s, k, d)
        tiers = int(get("device_bytes", 0)) + int(get("host_bytes", 0)) + int(get("disk_bytes", 0))
        return {
            "state": int(get("state_bytes", tiers)),
            "device": int(get("device_bytes", 0)),
            "host": int(get("host_bytes", 0)),
            "disk": int(get("disk_bytes", 0)),
            "peak_device": int(get("peak_device_bytes", 0)),
            "paged_in": int(get("bytes_paged_in", 0)),
            "paged_out": int(get("bytes_paged_out", 0)),
            "page_faults": int(get("page_faults", 0)),
        }
    total = sum(
        t.nbytes
        for st in optimizer.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    return {"state": total, "device": total, "host": 0, "disk": 0, "peak_device": total,
            "paged_in": 0, "paged_out": 0, "page_faults": 0}


def measure_report(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    base_numel: int | None = None,
) -> MemoryReport:
    """Measure every piece on a prepared model and a real batch.

    Args:
        model: A model from :func:`tightfit.prepare`.
        batch: A training batch (``input_ids``, ``labels``) on the model's device.
        optimizer: The optimizer in use (its state after at least one step is what is
            counted; before any step a paged optimizer may hold nothing yet).
        base_numel: Parameters of the unprepared model (default: from ``model.tightfit_info``).

    Returns:
        The report. The model's gradients are cleared; its RNG stream is untouched.
    """
    info = getattr(model, "tightfit_info", None)
    if base_numel is None:
        base_numel = info.base_numel if info is not None else sum(
            p.numel() for p in model.parameters())
    w = pieces.weight_bytes(model)
    c = pieces.constant_bytes(model)
    lora_numel, lora_bytes = pieces.lora_parameter_bytes(model)

    # Activations: the real batch, the plan + chunked loss on, then both off.
    with_peak, grads = pieces.step_activation_peak(model, batch)
    with pieces.memory_pieces_off(model):
        without_peak, _ = pieces.step_activation_peak(model, batch)

    rows = [
        Piece("base weights", "base weight storage", "bf16", w.bf16_bytes, "NF4", w.packed_bytes,
              {"params": w.numel, "expert_params": w.expert_numel,
               "bits_per_param": 8 * w.packed_bytes / max(w.numel, 1)}),
        Piece("quantization constants", "the quantization constants", "fp32 absmax",
              c.single_bytes, "double quant", c.double_bytes,
              {"bits_per_param_without": c.single_bits_per_param,
               "bits_per_param_with": c.double_bits_per_param,
               "lookup_table_bytes": c.code_bytes}),
        Piece("trainable params + grads", "trainable parameters, grads", "full (bf16)",
              2 * base_numel * pieces.BF16_BYTES, "LoRA", lora_bytes + grads,
              {"trainable_params": lora_numel, "param_bytes": lora_bytes, "grad_bytes": grads,
               "full_params": base_numel}),
        Piece("activations", "activation memory", "no checkpointing", without_peak,
              "plan + chunked loss", with_peak, _plan_detail(info)),
    ]
    if optimizer is not None:
        tiers = optimizer_state_bytes(optimizer)
        rows.append(Piece(
            "optimizer state", "optimizer-state spikes (OOM mid-run)",
            "full AdamW (fp32)", base_numel * 2 * pieces.FP32_BYTES,
            f"{type(optimizer).__name__} (LoRA)", tiers.pop("state"), tiers,
        ))
    meta = {
        "model": type(_base(model)).__name__,
        "device": str(next(model.parameters()).device),
        "batch": "x".join(str(s) for s in batch["input_ids"].shape),
        "base_params": base_numel,
        "frozen_other_bytes": pieces.frozen_other_bytes(model),
        "without": "full fine-tuning in bf16, fp32 absmax, no checkpointing, unchunked loss",
    }
    return MemoryReport(rows, meta)


def _base(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _plan_detail(info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    d: dict[str, Any] = {"policy": info.options.checkpoint, "loss_chunks": info.loss_chunks}
    plan = info.plan
    if plan is not None and getattr(plan, "predicted_peak_bytes", None) is not None:
        d["predicted_peak_bytes"] = int(plan.predicted_peak_bytes)
    return d
