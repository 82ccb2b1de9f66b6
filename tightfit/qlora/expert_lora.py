"""LoRA on 4-bit MoE experts, through peft's parameter targets.

peft adapts a fused 3-D expert weight with ``LoraConfig(target_parameters=[...])``: a
``ParamWrapper`` around the experts module holds ``lora_A`` ``[r * E, in]`` and ``lora_B``
``[out, r * E]`` (one rank-``r`` pair per expert) and, in forward, parametrizes the weight
as ``W + scaling * B_e @ A_e`` for the whole stack. With the stack in 4 bits
(:mod:`tightfit.qlora.experts`) that would dequantize every expert at once, so the
:class:`ParamWrapper` here keeps peft's layer (its adapters, names, saved files, enable/
disable logic) and changes only how the adapters reach the weight: the experts module adds
``scaling * (x @ A_e.T) @ B_e.T`` to each expert's 4-bit matmul, for the tokens routed to
that expert, the same function of the same parameters. Computed that way, LoRA dropout (on
the adapter's input) is possible too, which peft's own ParamWrapper refuses.

The adapter files are peft's: they load with plain peft onto the unquantized model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import ParamWrapper as _PeftParamWrapper
from torch import nn

from tightfit.qlora.experts import ExpertLora, expert_specs, is_4bit_experts, set_expert_lora


class ParamWrapper(_PeftParamWrapper):
    """peft's ``ParamWrapper`` for a weight of a 4-bit experts module.

    The class keeps peft's name on purpose: peft recognises the wrappers it nests (one per
    adapted weight of a module) by the class name ``"ParamWrapper"``.

    ``lora_compute_dtype`` (set by :func:`tightfit.qlora.lora_compute.compute_in_compute_dtype`):
    the dtype the adapters' matmuls run in, their stacked factors cast to it once per
    forward (autograd takes the gradients back to the fp32 parameters); ``None``: the
    adapters' own dtype, the experts' input cast to it (as peft's linears do).
    """

    lora_compute_dtype: torch.dtype | None = None

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, parameter_name: str,
        config: LoraConfig, **kwargs: Any,
    ) -> None:
        # peft's __init__ refuses dropout (its parametrization cannot apply it); this layer
        # applies it per expert, so peft is handed the config without it
        object.__setattr__(self, "_pending_dropout", config.lora_dropout)
        super().__init__(base_layer, adapter_name, parameter_name, _without_dropout(config),
                         **kwargs)

    def update_layer(
        self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs: Any
    ) -> None:
        p = config.lora_dropout or self.__dict__.pop("_pending_dropout", 0.0)
        super().update_layer(adapter_name, r, lora_alpha, _without_dropout(config), **kwargs)
        if p:
            self.lora_dropout[adapter_name] = nn.Dropout(p)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # peft reads the parameter's shape; the 4-bit stack's shape is its packed bytes, so
        # give peft the shape the model declared (peft then orients in/out as usual)
        num_experts, in_features, out_features = expert_specs(module)[self.parameter_name].shape
        self.num_experts = num_experts
        self._param_ndim = 3
        return in_features, out_features

    @contextmanager
    def _activate_lora(self, active_adapters: list[str]) -> Iterator[None]:
        factors = [
            ExpertLora(self._factor(self.lora_A[a].weight), self._factor(self.lora_B[a].weight),
                       float(self.scaling[a]), self.lora_dropout[a])
            for a in active_adapters if a in self.lora_A
        ]
        base = self.get_base_layer()
        set_expert_lora(base, self.parameter_name, factors)
        try:
            yield
        finally:
            set_expert_lora(base, self.parameter_name, None)

    def _factor(self, weight: torch.Tensor) -> torch.Tensor:
        dtype = self.lora_compute_dtype
        return weight if dtype is None or weight.dtype == dtype else weight.to(dtype)

    def _refuse_merge(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "LoRA on 4-bit experts cannot be merged into the 4-bit weights; load the "
            "unquantized model with peft (PeftModel.from_pretrained on the saved adapter) "
            "and merge there."
        )

    merge = unmerge = get_delta_weight = get_delta_factors = _refuse_merge


def _without_dropout(config: LoraConfig) -> LoraConfig:
    if not config.lora_dropout:
        return config
    config = copy.copy(config)
    config.lora_dropout = 0.0
    return config


def custom_modules(model: nn.Module) -> dict[type[nn.Module], type[nn.Module]]:
    """peft's custom-module mapping (``LoraConfig._register_custom_module``) for ``model``'s
    4-bit experts modules: each such class is adapted by :class:`ParamWrapper`."""
    return {type(m): ParamWrapper for m in model.modules() if is_4bit_experts(m)}
