"""The per-piece memory report: what each piece of the QLoRA stack saved, measured.

One row per piece, as in the design's table "piece -> memory pain it targets", each with the
bytes *without* the piece (full fine-tuning in bf16, fp32 absmax, no checkpointing, ...) and
*with* it, counted from the prepared model's real tensors and measured on the real batch
(see :mod:`tightfit.report.pieces`). A piece that did not run (``--quant none``,
``--no-double-quant``, ``--checkpoint none --loss-chunks none``) is a row that says what ran
instead, marked off, with no saving. Rendered as a text table, JSON, Markdown and PNG bars
(:mod:`tightfit.report.document`).

Example::

    report = measure_report(model, batch, optimizer=opt)
    print(report.table())
    report.save("out/")          # report.json, report.md, memory_report.png
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tightfit.loss import is_chunked_loss_enabled
from tightfit.qlora.prepare import PrepareInfo
from tightfit.report import pieces
from tightfit.report.document import MemoryReport, Piece

__all__ = ["MemoryReport", "Piece", "measure_report", "optimizer_state_bytes"]


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
    without_activation_bytes: int | None = None,
) -> MemoryReport:
    """Measure every piece on a prepared model and a real batch.

    Args:
        model: A model from :func:`tightfit.prepare`.
        batch: A training batch (``input_ids``, ``labels``) on the model's device.
        optimizer: The optimizer in use (its state after at least one step is what is
            counted; before any step a paged optimizer may hold nothing yet). Its figures are
            read first, before the activation passes.
        base_numel: Parameters of the unprepared model (default: from ``model.tightfit_info``).
        without_activation_bytes: Shown for the activations without the checkpoint plan and
            the chunked loss instead of measuring that step (a prediction, for when running
            the batch without them could exhaust the memory); the row says so.

    Returns:
        The report. The model's gradients are cleared; its RNG stream is untouched.
    """
    info = getattr(model, "tightfit_info", None)
    if base_numel is None:
        base_numel = info.base_numel if info is not None else sum(
            p.numel() for p in model.parameters())
    tiers = optimizer_state_bytes(optimizer) if optimizer is not None else None
    lora = _has_lora(model, info)
    rows = [_weights_row(model), _constants_row(model)]
    quantized = rows[0].used  # the base weights' row: in 4 bits, or plain linears
    activations, grads = _activations_row(model, batch, info, without_activation_bytes)
    lora_numel, lora_bytes = pieces.lora_parameter_bytes(model)
    rows.append(Piece(
        "trainable params + grads", "trainable parameters, grads", "full (bf16)",
        2 * base_numel * pieces.BF16_BYTES, "LoRA" if lora else "no LoRA (fp params)",
        lora_bytes + grads,
        {"trainable_params": lora_numel, "param_bytes": lora_bytes, "grad_bytes": grads,
         "full_params": base_numel}, used=lora))
    rows.append(activations)
    if tiers is not None:
        name = type(optimizer).__name__ + (" (LoRA)" if lora else "")
        rows.append(Piece("optimizer state", "optimizer-state spikes (OOM mid-run)",
                          "full AdamW (fp32)", base_numel * 2 * pieces.FP32_BYTES, name,
                          tiers.pop("state"), tiers))
    meta = {
        "model": type(_base(model)).__name__,
        "device": str(next(model.parameters()).device),
        "batch": "x".join(str(s) for s in batch["input_ids"].shape),
        "base_params": base_numel,
        "frozen_other_bytes": pieces.frozen_other_bytes(model, plain_linears=not quantized),
        "without": "full fine-tuning in bf16, fp32 absmax, no checkpointing, unchunked loss",
        "off": [p.name for p in rows if not p.used],
    }
    return MemoryReport(rows, meta)


def _weights_row(model: nn.Module) -> Piece:
    """The 4-bit base weights as bitsandbytes stores them (NF4 or FP4), or the unquantized
    linear weights when nothing is in 4 bits."""
    pain = "base weight storage"
    w = pieces.weight_bytes(model)
    if w.numel:
        return Piece("base weights", pain, "bf16", w.bf16_bytes,
                     "/".join(k.upper() for k in w.quant_types), w.packed_bytes,
                     {"params": w.numel, "expert_params": w.expert_numel,
                      "bits_per_param": 8 * w.packed_bytes / max(w.numel, 1)})
    numel, nbytes, dtype = pieces.plain_linear_weights(model)
    return Piece("base weights", pain, "bf16", numel * pieces.BF16_BYTES,
                 f"not quantized ({dtype})", nbytes, {"params": numel}, used=False)


def _constants_row(model: nn.Module) -> Piece:
    """The absmax constants as the model holds them: double-quantized, or fp32 when double
    quantization is off (then no saving is shown), or none at all without 4-bit weights."""
    name, pain = "quantization constants", "the quantization constants"
    c = pieces.constant_bytes(model)
    if not c.weights:
        return Piece(name, pain, "fp32 absmax", 0, "none (not quantized)", 0, used=False)
    if c.nested == c.weights:
        return Piece(name, pain, "fp32 absmax", c.single_bytes, "double quant", c.double_bytes,
                     {"bits_per_param_without": c.single_bits_per_param,
                      "bits_per_param_with": c.double_bits_per_param,
                      "lookup_table_bytes": c.code_bytes})
    label = ("fp32 absmax (no double quant)" if not c.nested else
             f"double quant on {c.nested} of {c.weights} weights")
    return Piece(name, pain, "fp32 absmax", c.single_bytes, label, c.stored_bytes,
                 {"bits_per_param": 8 * c.stored_bytes / max(c.numel, 1),
                  "lookup_table_bytes": c.code_bytes}, used=bool(c.nested))


def _activations_row(
    model: nn.Module, batch: Mapping[str, torch.Tensor], info: PrepareInfo | None,
    without_peak: int | None
) -> tuple[Piece, int]:
    """The activation peak of one step as it ran, beside the same step without a checkpoint
    plan and without the chunked loss (measured once when neither was on; ``without_peak``
    given: that prediction instead); the grad bytes."""
    plan = getattr(info, "plan", None)
    chunked = _chunked(model)
    with_peak, grads = pieces.step_activation_peak(model, batch)
    if plan is None and not chunked:
        return Piece("activations", "activation memory", "no checkpointing", with_peak,
                     "no checkpointing, unchunked loss", with_peak, {}, used=False), grads
    without = "no checkpointing"
    if without_peak is None:
        with pieces.memory_pieces_off(model):
            without_peak, _ = pieces.step_activation_peak(model, batch)
    else:
        without = "no checkpointing (predicted, not run: it would not fit the memory left)"
    ran = [f"{plan.policy} checkpoint plan" if plan is not None else "no checkpointing",
           "chunked loss" if chunked else "unchunked loss"]
    detail: dict[str, Any] = {"policy": plan.policy if plan is not None else "none",
                              "loss_chunks": getattr(info, "loss_chunks", None) if chunked
                              else "none"}
    if plan is not None and getattr(plan, "predicted_peak_bytes", None) is not None:
        detail["plan_predicted_peak_bytes"] = int(plan.predicted_peak_bytes)
    return Piece("activations", "activation memory", without, without_peak,
                 " + ".join(ran), with_peak, detail), grads


def _chunked(model: nn.Module) -> bool:
    try:
        return is_chunked_loss_enabled(model)
    except TypeError:  # not an HF causal LM: no chunked loss on it
        return False


def _has_lora(model: nn.Module, info: PrepareInfo | None) -> bool:
    if info is not None:
        return info.lora is not None
    return callable(getattr(model, "get_base_model", None))  # a peft model


def _base(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model
