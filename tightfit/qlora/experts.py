"""NF4 storage for MoE experts kept as fused 3-D parameters (transformers 5).

transformers 5 stores a MoE layer's experts as one module (decorated with
``@use_experts_implementation``) holding 3-D parameters: ``gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]`` for Mixtral and Qwen3-MoE; gpt-oss keeps them transposed
(``[E, in, out]``) with biases and interleaved gate/up columns. bitsandbytes has no layer for
them and transformers' bnb integration leaves them in 16 bit: on Mixtral-8x7B that is most of
the model.

Here each expert's projection is quantized on its own with bitsandbytes' ``quantize_4bit``
(blockwise NF4/FP4, optionally double quant), exactly the storage ``Params4bit`` gives a
linear layer. Per projection the module keeps one packed ``uint8`` parameter ``[E, n / 2]``
under the projection's own name, and its constants as buffers. The module then gets a
forward with the model's routing that runs, per expert that has tokens, bitsandbytes'
``matmul_4bit`` on that expert's packed weight. ``matmul_4bit`` keeps the packed weight (not
a dequantized copy) for backward and dequantizes again there, so one expert's projection is
dequantized at a time and freed after its matmul; checkpoint recompute just runs it again.
The flags the decorator sets (``has_gate``, ``has_bias``, ``is_transposed``,
``has_post_expert_norm``) and the module's own ``_apply_gate``/``act_fn`` decide the math,
so every family built on that contract is handled the same way. LoRA on these weights is
:mod:`tightfit.qlora.expert_lora`.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
import torch.nn.functional as F
from torch import Tensor, nn

_SPECS = "_tightfit_experts"  # name -> ExpertWeight, on a converted experts module
_LORA = "_tightfit_expert_lora"  # name -> [ExpertLora] while peft's forward runs
_FLAGS = ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel")


@dataclass(frozen=True)
class ExpertWeight:
    """How one 3-D expert weight of a module is stored in 4 bits.

    Attributes:
        name: The parameter's name on the experts module (``"gate_up_proj"``).
        shape: Its shape as the model declares it, ``[E, a, b]``.
        transposed: The model stores ``[E, in, out]`` (gpt-oss) rather than ``[E, out, in]``;
            each expert is quantized as ``[out, in]`` either way (bitsandbytes' orientation).
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: Weights per absmax.
        nested: Double quantization (8-bit absmax + fp32 second-level absmax and offset).
        dtype: Dtype bitsandbytes dequantizes to: the compute dtype, so the one transient
            dequantized expert is no wider than the matmul needs.
    """

    name: str
    shape: tuple[int, int, int]
    transposed: bool
    quant_type: str
    blocksize: int
    nested: bool
    dtype: torch.dtype

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def out_in(self) -> tuple[int, int]:
        """One expert's ``(out_features, in_features)``."""
        a, b = self.shape[1:]
        return (b, a) if self.transposed else (a, b)

    def quant_state(self, module: nn.Module, expert: int) -> bnbF.QuantState:
        """bitsandbytes' ``QuantState`` of one expert, built on views of the module's buffers."""
        state2 = offset = None
        if self.nested:
            state2 = bnbF.QuantState(
                absmax=getattr(module, f"{self.name}_absmax2")[expert],
                code=getattr(module, f"{self.name}_code2"),
                blocksize=256,  # bitsandbytes' nested block (quantize_4bit's, fixed)
                dtype=torch.float32,
            )
            offset = getattr(module, f"{self.name}_offset")[expert]
        return bnbF.QuantState(
            absmax=getattr(module, f"{self.name}_absmax")[expert],
            shape=torch.Size(self.out_in),
            code=getattr(module, f"{self.name}_code"),
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=offset,
            state2=state2,
        )

    def dequantize(self, module: nn.Module, expert: int) -> Tensor:
        """One expert's weight back in full precision, in the model's layout."""
        packed = getattr(module, self.name)[expert]
        w = bnbF.dequantize_4bit(packed.view(-1, 1), self.quant_state(module, expert))
        return w.t() if self.transposed else w


def expert_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The 3-D weights of an ``@use_experts_implementation`` module (biases stay as they are)."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` follows transformers' fused-experts contract (quantized or not)."""
    if not all(hasattr(module, f) for f in _FLAGS):
        return False
    if hasattr(module, _SPECS):
        return True
    params = [getattr(module, n, None) for n in expert_weight_names(module)]
    return all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params)


def is_4bit_experts(module: nn.Module) -> bool:
    """Whether :func:`quantize_experts` converted ``module``."""
    return hasattr(module, _SPECS)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused-experts module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def check_experts(model: nn.Module) -> None:
    """Refuse expert weights this module cannot quantize or adapt correctly, before any change.

    Raises:
        ValueError: A floating parameter with three or more dimensions outside a fused-experts
            module (e.g. Llama 4's ``Llama4TextExperts``, whose forward takes pre-sorted
            tokens), or an experts module sharded for expert parallelism.
    """
    handled = {id(getattr(m, w)) for _, m in expert_modules(model) for w in expert_weight_names(m)}
    for qual, module in model.named_modules():
        if is_experts_module(module) and module._is_expert_parallel:
            raise ValueError(
                f"{qual} ({type(module).__name__}) is sharded for expert parallelism, which "
                "tightfit's 4-bit experts do not support; load the model without an expert-"
                "parallel plan (tightfit shards with FSDP2 instead)."
            )
        for pname, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dim() >= 3 and id(p) not in handled:
                raise ValueError(
                    f"{qual}.{pname} ({type(module).__name__}, shape {tuple(p.shape)}) is a "
                    f"{p.dim()}-D weight tightfit cannot quantize or adapt correctly: only "
                    "transformers' fused experts (@use_experts_implementation: Mixtral, "
                    "Qwen3-MoE, gpt-oss, ...) are supported, and "
                    f"{type(module).__name__}'s forward does not follow that contract. "
                    "Pass quant=None and lora=False to fine-tune it fully, or use another model."
                )


def quantize_experts(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Store every fused-experts weight of ``model`` in 4 bits, one expert at a time.

    Each expert goes to ``device`` in fp32 (as ``Params4bit`` quantizes a linear weight) and is
    quantized there; its full-precision original is dropped once the stack is packed.

    Args:
        model: Model to change in place (call :func:`check_experts` first).
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: Quantize each expert's absmax constants too (bitsandbytes' nested state).
        blocksize: Weights per absmax.
        compute_dtype: Dtype of the matmuls (and of each expert's dequantized weight).
        device: Where the packed weights and constants live.

    Returns:
        Qualified names of the quantized weights (``"model.layers.0.mlp.experts.down_proj"``).
    """
    device = torch.device(device)
    done: list[str] = []
    for qual, module in expert_modules(model):
        if is_4bit_experts(module):
            continue
        specs = {}
        for name in expert_weight_names(module):
            specs[name] = _quantize_stack(module, name, quant_type, double_quant, blocksize,
                                          compute_dtype, device)
            done.append(f"{qual}.{name}")
        setattr(module, _SPECS, specs)
        setattr(module, _LORA, {})
        module.forward = types.MethodType(_forward_4bit, module)
    return done


def _quantize_stack(
    module: nn.Module, name: str, quant_type: str, nested: bool, blocksize: int,
    compute_dtype: torch.dtype, device: torch.device,
) -> ExpertWeight:
    weight = getattr(module, name).data
    transposed = bool(module.is_transposed)
    # filled expert by expert: the packed stack is allocated once, no list-then-stack copy
    out: dict[str, Tensor] = {}
    for e in range(weight.shape[0]):
        w = weight[e].t() if transposed else weight[e]
        q, qs = bnbF.quantize_4bit(
            w.to(device, torch.float32).contiguous(), blocksize=blocksize,
            compress_statistics=nested, quant_type=quant_type, quant_storage=torch.uint8,
        )
        parts = {"": q.view(-1), "_absmax": qs.absmax}
        if nested:
            parts |= {"_absmax2": qs.state2.absmax, "_offset": qs.offset.reshape(())}
        for key, t in parts.items():
            if e == 0:
                out[key] = t.new_empty((weight.shape[0], *t.shape))
            out[key][e] = t
    spec = ExpertWeight(name, tuple(weight.shape), transposed, quant_type, blocksize, nested,
                        compute_dtype)
    delattr(module, name)  # the full-precision stack goes; nothing else references it
    module.register_parameter(name, nn.Parameter(out.pop(""), requires_grad=False))
    for key, t in out.items():
        module.register_buffer(f"{name}{key}", t)
    module.register_buffer(f"{name}_code", qs.code)
    if nested:
        module.register_buffer(f"{name}_code2", qs.state2.code)
    return spec


def expert_specs(module: nn.Module) -> dict[str, ExpertWeight]:
    """The 4-bit weights of a converted experts module, by name."""
    return getattr(module, _SPECS)


def packed_experts(model: nn.Module) -> Iterator[tuple[str, Tensor, bnbF.QuantState]]:
    """``(name, packed, quant_state)`` of every expert of every 4-bit experts module.

    ``packed`` is the expert's row of the packed stack (a view), ``quant_state`` its
    bitsandbytes state: what a ``Linear4bit`` weight and its ``quant_state`` are for a layer.
    """
    for qual, module in model.named_modules():
        if not is_4bit_experts(module):
            continue
        for name, spec in expert_specs(module).items():
            stack = getattr(module, name)
            for e in range(spec.num_experts):
                yield f"{qual}.{name}[{e}]", stack[e], spec.quant_state(module, e)


@dataclass(frozen=True)
class ExpertLora:
    """One LoRA adapter on a 3-D expert weight, in peft's ``ParamWrapper`` layout.

    ``lora_a`` is ``lora_A.weight`` ``[r * E, in]`` and ``lora_b`` is ``lora_B.weight``
    ``[out, r * E]``: expert ``e`` owns rank rows ``e * r .. e * r + r`` of A and the columns
    ``e, e + E, ...`` of B (peft's ``get_delta_factors``). ``dropout`` acts on the adapter's
    input, per expert (peft's LoRA dropout, which its own ParamWrapper cannot apply).
    """

    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    dropout: nn.Module


def set_expert_lora(module: nn.Module, name: str, adapters: list[ExpertLora] | None) -> None:
    """Have ``module``'s forward add these adapters to weight ``name`` (``None``: none)."""
    lora = getattr(module, _LORA)
    if adapters:
        lora[name] = adapters
    else:
        lora.pop(name, None)


def _forward_4bit(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward, each projection a 4-bit matmul of one expert."""
    out = torch.zeros_like(hidden_states)
    k = top_k_index.shape[-1]
    with torch.no_grad():
        # routed (token, slot) pairs grouped by expert: a sort, not transformers' eager
        # one-hot mask, which is [experts, k, tokens] int64 (64 MiB at 128 experts, k = 8
        # and 8k tokens)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
    first, down = expert_weight_names(self)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        token_idx, top_k_pos = pairs // k, pairs % k
        h = _project(self, first, hidden_states[token_idx], e)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _project(self, down, h, e)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def _project(module: nn.Module, name: str, x: Tensor, e: int) -> Tensor:
    """``x @ W_e.T (+ b_e)`` with expert ``e``'s packed weight, plus its LoRA terms."""
    spec = expert_specs(module)[name]
    bias = getattr(module, f"{name}_bias")[e] if module.has_bias else None
    packed = getattr(module, name)[e].view(-1, 1)
    y = bnb.matmul_4bit(x, packed.t(), quant_state=spec.quant_state(module, e), bias=bias)
    n = spec.num_experts
    for lora in getattr(module, _LORA).get(name, ()):
        r = lora.lora_a.shape[0] // n
        a_e = lora.lora_a.view(n, r, -1)[e]  # [r, in]
        b_e = lora.lora_b.view(lora.lora_b.shape[0], r, n)[:, :, e]  # [out, r]
        # adapters train in their own (fp32) dtype, as peft's Linear casts its input
        x_a = lora.dropout(x.to(a_e.dtype))
        y = y + (F.linear(F.linear(x_a, a_e), b_e) * lora.scaling).to(y.dtype)
    return y
