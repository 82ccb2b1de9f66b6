"""What :func:`tightfit.prepare` left in full precision or without adapters, said out loud.

A weight matrix that stays 16/32-bit or gets no LoRA is a decision the user should see: the
output head and the embeddings by design, a MoE router because it is a bare parameter
rather than a linear layer, anything else because the options or the model excluded it.
These notes go into ``PrepareInfo.notes`` (``tightfit train`` prints them); no skip is silent.
"""

from __future__ import annotations

import re
from collections import Counter

import bitsandbytes as bnb
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from tightfit.qlora.experts import expert_specs, is_4bit_experts

_LAYER = re.compile(r"\.\d+\.")


def _plain_name(name: str) -> str:
    """A parameter's name as the unwrapped model has it (no peft prefix or base_layer)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _group(names: list[str]) -> str:
    """``model.layers.*.mlp.gate.weight x2, lm_head.weight`` from a list of names."""
    counts = Counter(_LAYER.sub(".*.", n) for n in names)
    return ", ".join(f"{k} x{c}" if c > 1 else k for k, c in counts.items())


def _reason(module: nn.Module, param_name: str, model: nn.Module) -> str:
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out) and get_out() is module:
        return "output head"
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if param_name == "weight" and type(module).__name__.endswith("Router"):
        return "MoE router: a bare parameter, not nn.Linear"
    return type(module).__name__


def _weights(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(qualified name, module, parameter name, tensor)`` of every base weight matrix."""
    out, seen = [], set()
    for qual, module in model.named_modules():
        if "lora_" in qual:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() >= 2 and id(p) not in seen:  # a tied head is the embedding: once
                seen.add(id(p))
                out.append((f"{qual}.{pname}" if qual else pname, module, pname, p))
    return out


def _is_4bit(module: nn.Module, pname: str, p: torch.Tensor) -> bool:
    if isinstance(p, bnb.nn.Params4bit):
        return True
    return is_4bit_experts(module) and pname in expert_specs(module)


def _has_lora(model: nn.Module, qual: str) -> bool:
    """Whether the weight ``qual`` is adapted: its module (or its wrapper) holds lora_A."""
    owner = qual.rpartition(".")[0].replace(".base_layer", "")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    while isinstance(module, LoraLayer):
        if getattr(module, "parameter_name", qual.rpartition(".")[2]) == qual.rpartition(".")[2]:
            return bool(module.lora_A)
        module = module.base_layer
    return False


def coverage_notes(model: nn.Module, *, quantized: bool, adapted: bool) -> list[str]:
    """Notes naming the weight matrices not in 4 bits and those without LoRA.

    Args:
        model: The prepared model (a peft model when LoRA is on).
        quantized: Whether a 4-bit base was asked for.
        adapted: Whether LoRA was asked for.
    """
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    notes = []
    weights = _weights(model)
    if quantized:
        kept = [(q, m, n, p) for q, m, n, p in weights if not _is_4bit(m, n, p)]
        if kept:
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for *_, p in kept})
            numel = sum(p.numel() for *_, p in kept)
            notes.append(
                f"not 4-bit (kept in {'/'.join(dtypes)}, {numel:,} params): "
                + "; ".join(f"{_group(names)} ({why})"
                            for why, names in _by_reason(kept, base).items())
            )
    if adapted:
        bare = [(q, m, n, p) for q, m, n, p in weights if not _has_lora(model, q)]
        if bare:
            notes.append(
                "no LoRA on: "
                + "; ".join(f"{_group(names)} ({why})"
                            for why, names in _by_reason(bare, base).items())
            )
    return notes


def _by_reason(
    weights: list[tuple[str, nn.Module, str, torch.Tensor]], base: nn.Module
) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for qual, module, pname, _ in weights:
        out.setdefault(_reason(module, pname, base), []).append(_plain_name(qual))
    return out
