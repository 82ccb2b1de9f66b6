"""Measure what each QLoRA memory piece costs, from the real tensors of a prepared model.

Every figure here is counted from tensors that exist (``nbytes`` of the packed 4-bit weights,
of the absmax constants and their nested quantization, of the LoRA parameters and their
gradients) or measured with :class:`~tightfit.measure.tracker.MemoryTracker` on a real batch.
The "without" side of a piece is the same tensors in their unreduced form: bf16 weights of the
same shapes, the fp32 absmax that double quantization replaced (dequantized back from the
nested constants), every parameter trainable, no checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
from torch import nn

from tightfit.checkpoint import apply as ckpt_apply
from tightfit.loss import disable_chunked_loss, enable_chunked_loss, is_chunked_loss_enabled
from tightfit.measure.tracker import MemoryTracker
from tightfit.qlora.experts import expert_specs, is_4bit_experts, packed_experts
from tightfit.qlora.quantize import layer_quant_state, linear4bit_layers
from tightfit.qlora.shardable import base_parameters

BF16_BYTES = 2
FP32_BYTES = 4


@dataclass(frozen=True)
class WeightBytes:
    """4-bit base weights: how many parameters, their packed bytes and their bf16 bytes.

    ``expert_numel`` is the part of ``numel`` in MoE experts (all of them, routed or not).
    """

    numel: int
    packed_bytes: int
    bf16_bytes: int
    expert_numel: int = 0
    quant_types: tuple[str, ...] = ()  # bitsandbytes' names, e.g. ("nf4",)


@dataclass(frozen=True)
class ConstantBytes:
    """Quantization constants with and without double quantization.

    ``single_bytes`` is one fp32 absmax per block; ``double_bytes`` is the 8-bit absmax plus
    the fp32 second-level absmax and offset. ``code_bytes`` are the lookup tables of the
    nested quantization (256 values each; a constant table, not per-block data), kept apart.
    """

    numel: int
    single_bytes: int
    double_bytes: int
    code_bytes: int
    stored_bytes: int = 0  # what the model holds: double_bytes where nested, single elsewhere
    nested: int = 0  # weights whose constants are double-quantized
    weights: int = 0  # 4-bit weights in all

    @property
    def single_bits_per_param(self) -> float:
        return 8 * self.single_bytes / max(self.numel, 1)

    @property
    def double_bits_per_param(self) -> float:
        return 8 * self.double_bytes / max(self.numel, 1)


def _four_bit(model: nn.Module) -> Iterator[tuple[int, bnbF.QuantState, bool]]:
    """``(packed bytes, quant state, is an expert)`` of every 4-bit weight: each
    ``Linear4bit`` layer, and each expert of each 4-bit experts module."""
    for _, layer in linear4bit_layers(model):
        codes, qs = layer_quant_state(layer)  # an FSDP2-sharded layer's gathered, one by one
        yield codes.untyped_storage().nbytes(), qs, False
    for _, packed, qs in packed_experts(model):
        yield packed.nbytes, qs, True


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the 4-bit weights (linear layers and MoE experts): parameters and bytes."""
    numel = packed = experts = 0
    kinds: set[str] = set()
    for nbytes, qs, is_expert in _four_bit(model):
        n = int(torch.Size(qs.shape).numel())
        numel += n
        experts += n if is_expert else 0
        packed += nbytes
        kinds.add(str(qs.quant_type))
    return WeightBytes(numel, packed, numel * BF16_BYTES, experts, tuple(sorted(kinds)))


def plain_linear_weights(model: nn.Module) -> tuple[int, int, str]:
    """``(params, bytes, dtype)`` of the frozen base linear weights that are not quantized.

    What ``--quant none`` leaves where the 4-bit weights would be: every frozen ``nn.Linear``
    (peft's base layers included) but the output head and the trainable adapters.
    """
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weights = [m.weight for m in model.modules()
               if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad]
    dtypes = sorted({str(w.dtype).removeprefix("torch.") for w in weights})
    return (sum(w.numel() for w in weights), sum(w.nbytes for w in weights),
            "/".join(dtypes) or "none")


def constant_bytes(model: nn.Module) -> ConstantBytes:
    """Count the quantization constants of every 4-bit layer, with and without DQ.

    When the model uses double quantization, the fp32 absmax it replaced is rebuilt with
    bitsandbytes' own dequantization (and counted); when it does not, the nested form is
    built with bitsandbytes' own ``quantize_blockwise`` (blocks of 256, as ``Params4bit``
    does) and counted. Either way both columns come from real tensors.
    """
    numel = single = double = code = stored = nested = weights = 0
    seen_codes: set[int] = set()
    for _, qs, _ in _four_bit(model):
        numel += int(torch.Size(qs.shape).numel())
        weights += 1
        nested += int(bool(qs.nested))
        if qs.nested:
            fp32_absmax = bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
            nested_absmax, state2, offset = qs.absmax, qs.state2, qs.offset
        else:
            fp32_absmax = qs.absmax
            offset = fp32_absmax.mean()
            nested_absmax, state2 = bnbF.quantize_blockwise(fp32_absmax - offset, blocksize=256)
        one_single = fp32_absmax.nbytes
        one_double = nested_absmax.nbytes + state2.absmax.nbytes + torch.as_tensor(offset).nbytes
        single += one_single
        double += one_double
        stored += one_double if qs.nested else one_single
        ptr = state2.code.data_ptr()
        if qs.nested and ptr not in seen_codes:  # shared tables (one per layer or expert
            seen_codes.add(ptr)  # stack) count once; without DQ there are none to hold
            code += state2.code.nbytes
    return ConstantBytes(numel, single, double, code, stored, nested, weights)


def lora_parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """``(numel, bytes)`` of the trainable parameters."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in ps), sum(p.nbytes for p in ps)


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients that exist now."""
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


def frozen_other_bytes(model: nn.Module, *, plain_linears: bool = False) -> int:
    """Bytes of frozen parameters that are not base weights (embeddings, norms, head, MoE
    routers): not 4-bit weights, nor (``plain_linears``, for an unquantized base) the frozen
    linear weights :func:`plain_linear_weights` counts."""
    packed = {
        id(getattr(m, name))
        for m in model.modules() if is_4bit_experts(m)
        for name in expert_specs(m)
    }
    packed |= {id(p) for p in base_parameters(model)}  # an FSDP2-shardable 4-bit base
    if plain_linears:
        head = getattr(model, "get_output_embeddings", lambda: None)()
        packed |= {id(m.weight) for m in model.modules()
                   if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad}
    return sum(
        p.nbytes
        for p in model.parameters()
        if not p.requires_grad and not isinstance(p, bnb.nn.Params4bit) and id(p) not in packed
    )


@contextlib.contextmanager
def memory_pieces_off(model: nn.Module) -> Iterator[None]:
    """Temporarily take the checkpoint plan and the chunked loss off ``model``."""

    chunked = is_chunked_loss_enabled(model)
    info = getattr(model, "tightfit_info", None)
    chunk = getattr(getattr(info, "options", None), "loss_chunks", None) or "auto"
    if chunked:
        disable_chunked_loss(model)
    try:
        with ckpt_apply.suspended(model):  # back on the blocks it was installed on
            yield
    finally:
        if chunked:
            enable_chunked_loss(model, chunk_tokens=chunk)


def step_activation_peak(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """Peak bytes one forward + backward allocates on ``batch``, and the gradient bytes left.

    Gradients are cleared first and after, and the RNG is forked, so measuring leaves the
    model and the training run exactly as they were.
    """
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), MemoryTracker(device) as mt:
        out = model(**batch)
        mt.mark("backward")
        out.loss.backward()
        del out
    grads = grad_bytes(model)
    model.zero_grad(set_to_none=True)
    return mt.peak_bytes, grads
