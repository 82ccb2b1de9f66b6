"""Swap a model's linear layers for bitsandbytes 4-bit ``Linear4bit`` (NF4/FP4, double quant),
and :func:`quantize_base`: the whole frozen base in 4 bits (linears and MoE experts) on its device.

bitsandbytes does the math (blockwise quantization, the nested quantization of the absmax
constants, the dequantize-matmul); this module only decides which layers and moves weights.
``Params4bit`` quantizes when it is moved to a device, on the CPU as well as on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import QuantState
from torch import nn

from tightfit.qlora.experts import quantize_experts
from tightfit.qlora.saved_quant_state import take_saved_quant_state
from tightfit.qlora.shardable import ShardableLinear4bit


def output_head_names(model: nn.Module) -> set[str]:
    """Qualified names of the output head (tied or not): it stays in full precision."""
    names = {"lm_head"}
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is not None:
        names |= {n for n, m in model.named_modules() if m is head}
    return names



def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """``(qualified name, parent, attribute name, layer)`` of every ``nn.Linear`` and GPT-2
    ``Conv1D`` but the output head, in module order: the layers :func:`quantize_linears`
    and :func:`linear4bit_skeleton` swap, so a one-process and a sharded run quantize the
    same layers in the same order. The modules are listed before the first is yielded: the
    caller may replace each layer as it comes."""
    from transformers.pytorch_utils import Conv1D

    skip = output_head_names(model)
    for qual, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full = f"{qual}.{name}" if qual else name
            if isinstance(child, (nn.Linear, Conv1D)) and full not in skip and name != "lm_head":
                yield full, module, name, child

def quantize_linears(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    blocksize: int = 64,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Replace every ``nn.Linear`` (and GPT-2 ``Conv1D``) except the output head with a
    quantized ``Linear4bit``.

    Args:
        model: Model to change in place.
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: Quantize the per-block absmax constants (bitsandbytes' ``compress_statistics``).
        compute_dtype: Dtype the layer dequantizes to for its matmul.
        blocksize: Weights per quantization block.
        device: Where the quantized weights live.

    Returns:
        The qualified names of the replaced layers.
    """
    from transformers.pytorch_utils import Conv1D

    device = torch.device(device)
    replaced: list[str] = []
    for full, module, name, child in quantizable_linears(model):
        if isinstance(child, Conv1D):
            # GPT-2's Conv1D computes x @ W + b with W stored [in, out]: the same layer as
            # a Linear whose weight is W transposed (as transformers' bnb integration does).
            in_f, out_f = child.weight.shape
            weight = child.weight.data.t()
        else:
            in_f, out_f, weight = child.in_features, child.out_features, child.weight.data
        q = bnb.nn.Linear4bit(
            in_f,
            out_f,
            bias=child.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=torch.uint8,
            device="meta",
        )
        # Quantization happens on the move to `device` (CPU or CUDA alike).
        q.weight = bnb.nn.Params4bit(
            weight.to(torch.float32).contiguous(),
            requires_grad=False,
            compress_statistics=double_quant,
            quant_type=quant_type,
            blocksize=blocksize,
            quant_storage=torch.uint8,
        ).to(device)
        if child.bias is not None:
            q.bias = nn.Parameter(
                child.bias.data.to(device, compute_dtype), requires_grad=False
            )
        # bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a layer in place at its
        # first no-grad forward (an eval): absmax becomes bf16 and stays so, so every later
        # training step computes with other constants (a resumed run is then not
        # bit-exact), and a row that is not whole blocks fails ("shape '[32, 0]' is
        # invalid"). A layer that trains keeps the one kernel and the constants it has.
        q.support_avx512bf16_for_cpu = False
        setattr(module, name, q)
        replaced.append(full)
    return replaced


def linear4bit_skeleton(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> list[str]:
    """:func:`quantize_linears`' swap with no data: each linear (but the head) becomes a
    ``Linear4bit`` whose weight is an empty ``Params4bit`` placeholder on the CPU.

    For a model on the meta device that is loaded shard by shard later
    (:mod:`tightfit.distributed.sharded_load`): peft wraps these layers as it wraps quantized
    ones (its LoRA weights stay on the CPU, for real), then
    :func:`tightfit.qlora.shardable.empty_shardable` gives them the quantized shapes.
    """
    from transformers.pytorch_utils import Conv1D

    replaced: list[str] = []
    for full, module, name, child in quantizable_linears(model):
        transposed = isinstance(child, Conv1D)
        in_f, out_f = (child.weight.shape if transposed
                       else (child.in_features, child.out_features))  # fmt: skip
        q = bnb.nn.Linear4bit(in_f, out_f, bias=child.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=double_quant,
                              quant_type=quant_type, quant_storage=torch.uint8,
                              device="meta")  # fmt: skip
        q.weight = bnb.nn.Params4bit(
            torch.empty(0, dtype=torch.uint8), requires_grad=False,
            compress_statistics=double_quant, quant_type=quant_type,
            quant_storage=torch.uint8, bnb_quantized=True,
        )  # fmt: skip
        if child.bias is not None:
            q.bias = nn.Parameter(torch.empty(out_f, dtype=compute_dtype, device="meta"),
                                  requires_grad=False)  # fmt: skip
        q.support_avx512bf16_for_cpu = False  # as quantize_linears: one kernel throughout
        q.transposed = transposed
        setattr(module, name, q)
        replaced.append(full)
    return replaced


def linear4bit_layers(model: nn.Module) -> Iterator[tuple[str, bnb.nn.Linear4bit]]:
    """Yield ``(name, layer)`` for every bitsandbytes 4-bit linear layer in ``model``
    (FSDP2-shardable ones, :class:`~tightfit.qlora.shardable.ShardableLinear4bit`, too)."""
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            yield name, module


def layer_quant_state(layer: bnb.nn.Linear4bit) -> tuple[torch.Tensor, QuantState]:
    """``(packed codes, quant state)`` of a whole 4-bit layer.

    A ``Linear4bit``'s own; a :class:`~tightfit.qlora.shardable.ShardableLinear4bit`
    sharded by FSDP2 gathers its codes and constants (a collective: every rank calls it for
    the same layers in the same order), one layer at a time.
    """
    if isinstance(layer, ShardableLinear4bit):
        return layer.full_quant_state()
    return layer.weight.data, layer.weight.quant_state


def quantize_base(
    model: nn.Module,
    *,
    quant: str | None,
    double_quant: bool,
    blocksize: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    train_base: bool,
) -> list[str]:
    """Freeze the base (unless ``train_base``), swap its linears for 4-bit ones and store its
    MoE experts in 4 bits (``quant``: ``"nf4"``, ``"fp4"``, or ``None`` for neither), put the
    rest in ``compute_dtype`` and move it all to ``device``.

    Returns:
        The qualified names of the layers and expert weights now in 4 bits.
    """
    for p in model.parameters():
        p.requires_grad_(train_base)
    quantized: list[str] = []
    if quant is not None:
        quantized = quantize_linears(model, quant_type=quant, double_quant=double_quant,
                                     compute_dtype=compute_dtype, blocksize=blocksize,
                                     device=device)  # fmt: skip
        quantized += quantize_experts(model, quant_type=quant, double_quant=double_quant,
                                      blocksize=blocksize, compute_dtype=compute_dtype,
                                      device=device)  # fmt: skip
    # The unquantized rest (embeddings, norms, head) in the compute dtype, on the device.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != compute_dtype:
            p.data = p.data.to(compute_dtype)
    model.to(device)
    for _, layer in linear4bit_layers(model):  # its state dict loads back (accelerate's
        take_saved_quant_state(layer)  # load_state): the saved quant state is taken
    return quantized
