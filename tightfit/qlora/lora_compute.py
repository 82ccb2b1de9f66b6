"""LoRA adapters that compute in the compute dtype, on fp32 master weights.

peft keeps the adapters in fp32 beside a 16-bit base (``autocast_adapter_dtype``) and each
LoRA layer casts its input to the adapters' dtype before ``lora_B(lora_A(dropout(x)))``:
``lora_A`` then saves that fp32 copy for backward, T·in·4 bytes per adapter, beside the
16-bit input the layer had (and q/k/v, gate/up each make their own copy of one input).

:func:`compute_in_compute_dtype` keeps the fp32 parameters and turns the casts the other
way, as autocast does and Unsloth's LoRA kernels do: peft's input cast is switched off
(its own ``cast_input_dtype_enabled`` switch, what ``peft.helpers.disable_input_dtype_casting``
sets) and ``lora_A`` / ``lora_B`` cast their weights to the input's dtype in forward
(``r·(in + out)`` values, small). Dropout and both matmuls then run on the 16-bit input, the
saved input is the one tensor q/k/v (gate/up) already share, and autograd takes each
weight's gradient back through the cast into the fp32 ``.grad`` of the master parameter,
so the optimizer and its state stay fp32. The adapters' names, files and merge are peft's.

MoE experts' adapters (:mod:`tightfit.qlora.expert_lora`) get the same: the stacked A/B
cast once per forward to the compute dtype.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# What the LoRA matmuls run in: the model's compute dtype (their fp32 weights cast to it,
# the default) or the adapters' own dtype (peft's behaviour: the input cast to it).
LoraCompute = Literal["compute_dtype", "lora_dtype"]
LORA_COMPUTES: tuple[LoraCompute, ...] = ("compute_dtype", "lora_dtype")
DEFAULT_LORA_COMPUTE: LoraCompute = "compute_dtype"  # LoraOptions' and the planner's


class _CastMatmul(torch.autograd.Function):
    """``x @ weight.T`` with ``weight`` cast to ``x``'s dtype, saving ``weight`` itself: the
    cast copy lives only while a matmul uses it (autograd's own ``weight.to(...)`` would
    keep it for backward, r·(in + out) 16-bit values per adapter and stored layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.to(grad.dtype)
        if ctx.needs_input_grad[1]:
            # the matmul in the compute dtype (as autocast's), its result to the master's
            flat_g, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_w = (flat_g.t() @ flat_x.to(grad.dtype)).to(weight.dtype)
        return grad_x, grad_w


class CastLinear(nn.Linear):
    """An adapter's ``lora_A`` / ``lora_B``: its weight (and bias) cast to the input's dtype
    for the matmul; the parameter keeps its own dtype and receives its gradient in it."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.dtype == x.dtype:
            return super().forward(x)
        if self.bias is None:  # peft's adapters have none (unless lora_bias=True)
            return _CastMatmul.apply(x, self.weight)
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


def compute_in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every LoRA adapter of the peft model ``model`` compute in ``dtype``.

    Each peft LoRA linear (``lora.Linear``, ``Linear4bit``, ``Linear8bitLt``) stops casting
    its input to the adapters' dtype and its ``lora_A`` / ``lora_B`` become
    :class:`CastLinear` (same parameters, same names); each 4-bit experts wrapper
    (:class:`~tightfit.qlora.expert_lora.ParamWrapper`) casts its stacked factors to
    ``dtype``. The input already arrives in ``dtype`` (the base layer's compute dtype).

    Args:
        model: A peft model (or any module holding peft LoRA layers).
        dtype: The compute dtype the adapters' matmuls run in.

    Returns:
        How many LoRA layers now compute in ``dtype``.

    Raises:
        ValueError: ``model`` holds no peft LoRA layer, or an adapter that is not a plain
            linear (an embedding or convolution adapter: it keeps peft's cast).
    """
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper

    from tightfit.qlora.expert_lora import ParamWrapper

    experts, linears = [], []
    for name, module in model.named_modules():  # checked whole before anything changes
        if isinstance(module, ParamWrapper):
            experts.append(module)
        elif isinstance(module, PeftParamWrapper):
            continue  # full-precision experts: peft folds the adapter into the weight
        elif isinstance(module, LoraLayer) and module.lora_A:
            adapters = [*module.lora_A.values(), *module.lora_B.values()]
            odd = [type(m).__name__ for m in adapters if not isinstance(m, nn.Linear)]
            if odd:
                raise ValueError(
                    f"LoRA layer {name!r} has {odd[0]} adapters, which cannot compute in the "
                    "compute dtype; pass LoRA compute='lora_dtype' (tightfit train "
                    "--lora-compute lora_dtype) or leave that layer out of target_modules.")
            linears.append((module, adapters))
    if not experts and not linears:
        raise ValueError("compute_in_compute_dtype() found no peft LoRA layer in the model; "
                         "add the adapters first (peft.get_peft_model or tightfit.prepare).")
    for wrapper in experts:
        wrapper.lora_compute_dtype = dtype
    for module, adapters in linears:
        module.cast_input_dtype_enabled = False  # peft's own switch of its input cast
        for m in adapters:
            m.__class__ = CastLinear
    return len(experts) + len(linears)
