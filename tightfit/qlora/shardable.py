"""The 4-bit base as parameters FSDP2 shards: codes, absmax and nested absmax per layer.

bitsandbytes keeps a 4-bit layer's quantization constants on its weight
(``Params4bit.quant_state``), out of FSDP2's sight: ``fully_shard`` would replace the weight
by a ``DTensor`` and lose them, so the base used to be passed as ``ignored_params`` and
replicated on every rank. :func:`make_shardable` turns each bitsandbytes ``Linear4bit`` into a
:class:`ShardableLinear4bit` whose per-block data are module parameters (frozen) that FSDP2
shards on dim 0 like any other:

* ``weight``: the packed 4-bit codes, ``[numel / 2, 1]`` ``uint8`` (bitsandbytes' own layout;
  FSDP2 in torch 2.13 all-gathers a group of mixed dtypes as bytes, so no float
  ``quant_storage`` is needed to shard them);
* ``absmax``: one constant per block of ``blocksize`` weights (``uint8`` codes under double
  quantization, else ``float32``);
* ``nested_absmax`` (double quantization only): one ``float32`` per 256 absmax codes.

What stays replicated is the same for every layer and does not grow with it: the 16-entry
code book (NF4/FP4), the 256-entry code book of the nested quantization and its offset
(1,092 bytes a layer, :data:`REPLICATED_BYTES`). FSDP2's own pre-forward/pre-backward hooks
gather a block's parameters before it runs (forward, recompute and backward) and free them
after; :meth:`ShardableLinear4bit.forward` builds bitsandbytes' ``QuantState`` from the
gathered tensors and runs the same ``matmul_4bit`` as ``Linear4bit``, so the math, and the
bits, are bitsandbytes' (tested against an unsharded run).
"""

from __future__ import annotations

from collections.abc import Iterator

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import QuantState
from torch import nn

from tightfit.optim.dtensor import is_dtensor, local_tensor

__all__ = [
    "BASE_PIECES",
    "REPLICATED_BYTES",
    "ShardableLinear4bit",
    "base_bytes",
    "base_parameters",
    "empty_shardable",
    "make_shardable",
    "shardable_layers",
]

BASE_PIECES = ("weight", "absmax", "nested_absmax")
# quant map (16 x fp32) + nested quant map (256 x fp32) + nested offset (fp32), per layer
REPLICATED_BYTES = 16 * 4 + 256 * 4 + 4


class ShardableLinear4bit(bnb.nn.Linear4bit):
    """A bitsandbytes ``Linear4bit`` whose codes and constants are plain parameters.

    Made by :func:`make_shardable` from a quantized ``Linear4bit`` (the data are moved, not
    copied); peft's LoRA layers wrap it as they wrap its base class.
    """

    shape: tuple[int, ...]
    transposed: bool  # built from a GPT-2 Conv1D ([in, out]): its source weight is W.t()
    blocksize: int
    nested_blocksize: int | None
    state_dtype: torch.dtype

    def quant_state_now(self) -> QuantState:
        """bitsandbytes' quant state over the layer's tensors as they are now (gathered
        inside FSDP2's forward/backward, this rank's shards outside)."""
        return self._quant_state(self.absmax, self.nested_absmax if self.nested else None)

    def _quant_state(self, absmax: torch.Tensor, nested_absmax: torch.Tensor | None) -> QuantState:
        """bitsandbytes' quant state of this layer over ``absmax`` (and, double-quantized,
        ``nested_absmax``) with the layer's replicated code books, shape and block sizes."""
        state2 = None
        if self.nested_blocksize is not None:
            state2 = QuantState(absmax=nested_absmax, code=self.nested_code,
                                blocksize=self.nested_blocksize, dtype=torch.float32)  # fmt: skip
        return QuantState(
            absmax=absmax, shape=torch.Size(self.shape), code=self.quant_map,
            blocksize=self.blocksize, quant_type=self.quant_type, dtype=self.state_dtype,
            offset=self.nested_offset if state2 is not None else None, state2=state2,
        )  # fmt: skip

    @property
    def nested(self) -> bool:
        """Whether the absmax constants are double-quantized."""
        return self.nested_blocksize is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Linear4bit.forward`` on the gathered tensors (same casts, same kernel)."""
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None:
            bias = bias.to(self.compute_dtype if self.compute_dtype is not None else x.dtype)
        out = bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=self.quant_state_now())
        return out.to(inp_dtype)

    def full_quant_state(self) -> tuple[torch.Tensor, QuantState]:
        """``(codes, quant state)`` of the whole layer, wherever it is: a sharded layer's
        tensors are gathered here (``DTensor.full_tensor``, a collective every rank must
        call in the same order), a gathered or unsharded layer's are its own."""
        if not is_dtensor(self.weight):
            return self.weight.data, self.quant_state_now()
        full = {n: _full(getattr(self, n)) for n in BASE_PIECES if n in self._parameters}
        return full["weight"], self._quant_state(full["absmax"], full.get("nested_absmax"))

    def dequantized(self) -> torch.Tensor:
        """The layer's weight dequantized (gathered first when sharded: a collective)."""
        codes, state = self.full_quant_state()
        return bnb.functional.dequantize_4bit(codes, state)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.quant_type}, blocksize={self.blocksize}, nested={self.nested}")


def make_shardable(layer: bnb.nn.Linear4bit) -> ShardableLinear4bit:
    """Turn a quantized ``Linear4bit`` into a :class:`ShardableLinear4bit` in place.

    Raises:
        ValueError: the layer is not quantized yet (its weight has no quant state).
    """
    if isinstance(layer, ShardableLinear4bit):
        return layer
    w = layer.weight
    qs = getattr(w, "quant_state", None)
    if qs is None:
        raise ValueError(
            "a bitsandbytes Linear4bit without a quant state cannot be sharded: quantize it "
            "first (move it to its device, as tightfit.prepare does)"
        )
    codes = w.data
    if getattr(qs, "packing_format_for_cpu", False):  # bitsandbytes' CPU repack: undo it
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        codes, qs = _convert_weight_packed_for_cpu_inverse(codes, qs)
    layer.__class__ = ShardableLinear4bit
    assert isinstance(layer, ShardableLinear4bit)
    del layer._parameters["weight"]
    layer.weight = _frozen(codes)
    layer.absmax = _frozen(qs.absmax)
    layer.shape, layer.blocksize, layer.state_dtype = tuple(qs.shape), qs.blocksize, qs.dtype
    layer.quant_type, layer.transposed = qs.quant_type, False
    layer.register_buffer("quant_map", qs.code, persistent=False)
    if qs.nested:
        layer.nested_absmax = _frozen(qs.state2.absmax)
        layer.register_buffer("nested_code", qs.state2.code, persistent=False)
        layer.register_buffer("nested_offset", torch.as_tensor(qs.offset), persistent=False)
        layer.nested_blocksize = qs.state2.blocksize
    else:
        layer.nested_blocksize = None
    layer.quant_state = None  # bitsandbytes' module-level copy: the parameters are the truth
    return layer


def empty_shardable(layer: bnb.nn.Linear4bit, *, blocksize: int) -> ShardableLinear4bit:
    """A :class:`ShardableLinear4bit` of ``layer``'s quantized shapes on the meta device,
    for a model loaded shard by shard (the data arrive after FSDP2 has cut them).

    ``layer`` is a :func:`tightfit.qlora.quantize.linear4bit_skeleton` layer: its kind,
    double quantization and compute dtype are kept; ``blocksize`` is the quantization's.
    """
    nested = bool(layer.weight.compress_statistics)
    quant_type = layer.weight.quant_type
    n = layer.in_features * layer.out_features
    blocks = -(-n // blocksize)
    transposed = getattr(layer, "transposed", False)
    layer.__class__ = ShardableLinear4bit
    assert isinstance(layer, ShardableLinear4bit)
    del layer._parameters["weight"]
    meta = torch.device("meta")
    layer.weight = _frozen(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=meta))
    layer.absmax = _frozen(torch.empty(blocks, dtype=torch.uint8 if nested else torch.float32,
                                       device=meta))  # fmt: skip
    layer.shape, layer.blocksize = (layer.out_features, layer.in_features), blocksize
    layer.state_dtype, layer.quant_type, layer.transposed = torch.float32, quant_type, transposed
    layer.register_buffer("quant_map", torch.empty(16, device=meta), persistent=False)
    if nested:
        layer.nested_absmax = _frozen(torch.empty(-(-blocks // 256), device=meta))
        layer.register_buffer("nested_code", torch.empty(256, device=meta), persistent=False)
        layer.register_buffer("nested_offset", torch.empty((), device=meta), persistent=False)
        layer.nested_blocksize = 256
    else:
        layer.nested_blocksize = None
    layer.quant_state = None
    return layer


def base_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of the 4-bit base: ``held`` (its shards), ``whole`` (the base's),
    ``block`` (the largest decoder layer's base: what one gather brings in)."""

    def sizes(module: nn.Module) -> tuple[int, int]:
        held = whole = 0
        for _, layer in shardable_layers(module):
            for piece in BASE_PIECES:
                p = layer._parameters.get(piece)
                if p is not None:
                    held += local_tensor(p).numel() * p.element_size()
                    whole += p.numel() * p.element_size()
        return held, whole

    from tightfit.model.blocks import find_blocks

    held, whole = sizes(model)
    blocks = find_blocks(model) if whole else []
    return {"held": held, "whole": whole,
            "block": max((sizes(b)[1] for b in blocks), default=0)}  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t.data


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


def shardable_layers(model: nn.Module) -> Iterator[tuple[str, ShardableLinear4bit]]:
    """``(name, layer)`` of every :class:`ShardableLinear4bit` in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, ShardableLinear4bit):
            yield name, module


def base_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The 4-bit base's sharded parameters (codes, absmax, nested absmax of every layer)."""
    return [getattr(layer, piece) for _, layer in shardable_layers(model)
            for piece in BASE_PIECES if piece in layer._parameters]  # fmt: skip
