"""Which MLPs run in tiles, and which module of each one is tiled.

A decoder layer's MLP can be tiled along its tokens when it acts on each token alone. Three
kinds are recognised, by their children (so peft-wrapped, 4-bit and plain models alike):

* ``"gate_up_down"``: Llama-family ``down(act(gate(x)) * up(x))`` with ``gate_proj``,
  ``up_proj`` and ``down_proj`` (Llama, Mistral, Qwen2/3, Gemma, and the dense layers of the
  MoE families). The MLP's own forward is tiled.
* ``"fused_gate_up"``: one ``gate_up_proj`` linear whose output is split into gate and up,
  and ``down_proj`` (Phi-3's ``Phi3MLP``). The MLP's own forward is tiled.
* ``"experts"``: a mixture-of-experts block with an ``experts`` child that follows
  transformers' fused-experts contract (``@use_experts_implementation``: ``has_gate``,
  ``num_experts``, a forward of ``(hidden_states, top_k_index, top_k_weights)``; Mixtral's
  ``MixtralSparseMoeBlock``, Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, gpt-oss's ``GptOssMLP``).
  The *experts* call is tiled, the router is not: the router runs once on all tokens, so the
  router logits transformers records (its ``OutputRecorder`` hooks the router module) are one
  ``[tokens, experts]`` tensor per layer with their graph, exactly as untiled, and the
  load-balancing loss sees them whole; the block's outputs (gpt-oss returns the routing
  scores too) are the untiled block's. Each token's experts and weights travel with it into
  its tile (routing is per token), so the tiled output is the untiled one. The module tiled
  is the outermost wrapper of ``experts`` (peft's ``ParamWrapper``), so the recompute in
  backward runs with the LoRA adapters active; tiling must therefore be enabled after the
  adapters are added (``tightfit.prepare`` does), and a tiled call checks it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

GATED, FUSED, EXPERTS = "gate_up_down", "fused_gate_up", "experts"
KINDS = (GATED, FUSED, EXPERTS)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# transformers' fused-experts contract (set by @use_experts_implementation)
_EXPERT_FLAGS = ("has_gate", "num_experts")
_EXPERT_ARGS = 3  # hidden_states, top_k_index, top_k_weights


@dataclass(frozen=True)
class TileTarget:
    """The module of one MLP whose forward runs in tiles.

    Attributes:
        kind: One of :data:`KINDS`.
        owner: The MLP (the block's child).
        module: The module whose forward is replaced: the MLP itself, or its ``experts``.
        intermediate: The inner width per token for the ``"auto"`` tile (an expert's for
            ``"experts"``, multiplied by the tokens' top-k at each call); ``None`` unknown.
    """

    kind: str
    owner: nn.Module
    module: nn.Module
    intermediate: int | None


def _is_module(parent: nn.Module, name: str) -> bool:
    return isinstance(getattr(parent, name, None), nn.Module)


def base_of(module: nn.Module) -> nn.Module:
    """The module under peft's wrappers (``base_layer`` chains), the module itself if none."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def _positive(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


def _fused_intermediate(mlp: nn.Module) -> int | None:
    config = getattr(mlp, "config", None)
    out = getattr(mlp.gate_up_proj, "out_features", None)
    return _positive(getattr(config, "intermediate_size", None),
                     out // 2 if isinstance(out, int) else None)


def _expert_intermediate(experts: nn.Module) -> int | None:
    config = getattr(experts, "config", None)
    return _positive(getattr(experts, "intermediate_dim", None),
                     getattr(experts, "intermediate_size", None),
                     getattr(config, "moe_intermediate_size", None),
                     getattr(config, "intermediate_size", None))


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` (under its peft wrappers) follows transformers' fused-experts contract."""
    base = base_of(module)
    return all(hasattr(base, f) for f in _EXPERT_FLAGS)


def tile_target(mlp: nn.Module) -> TileTarget | None:
    """How ``mlp`` is tiled (``None``: it is none of :data:`KINDS`)."""
    if all(_is_module(mlp, p) for p in PROJECTIONS):
        inter = _positive(getattr(mlp, "intermediate_size", None),
                          getattr(mlp.gate_proj, "out_features", None))
        return TileTarget(GATED, mlp, mlp, inter)
    if _is_module(mlp, "gate_up_proj") and _is_module(mlp, "down_proj"):
        return TileTarget(FUSED, mlp, mlp, _fused_intermediate(mlp))
    experts = getattr(mlp, "experts", None)
    if isinstance(experts, nn.Module) and is_fused_experts(experts):
        return TileTarget(EXPERTS, mlp, experts, _expert_intermediate(base_of(experts)))
    return None


def describe_refusal(mlp: nn.Module) -> str:
    """Why ``mlp`` cannot be tiled, and what can."""
    children = [n for n, _ in mlp.named_children()]
    return (f"{type(mlp).__name__} is not an MLP tiling knows (its children are {children}): "
            "tiling supports gate/up/down MLPs (Llama family), a fused gate_up_proj + "
            "down_proj MLP (Phi-3) and MoE blocks whose 'experts' follow transformers' "
            "fused-experts contract (Mixtral, Qwen3-MoE, gpt-oss), all acting per token")


def experts_arguments(target: TileTarget, args: tuple[Any, ...], kwargs: dict[str, Any],
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index, top_k_weights)`` of a call of the experts module,
    positional or by the names its class's forward gives them (gpt-oss: ``router_indices``,
    ``routing_weights``)."""
    if not kwargs and len(args) == _EXPERT_ARGS:
        return args  # type: ignore[return-value]
    forward = type(base_of(target.module)).forward
    params = list(inspect.signature(forward).parameters)[1:1 + _EXPERT_ARGS]
    bound = dict(zip(params, args)) | kwargs
    try:
        found = tuple(bound[p] for p in params)
    except KeyError as e:
        raise TypeError(f"{type(target.module).__name__} was called without {e.args[0]!r}; a "
                        f"tiled experts call needs {params}.") from None
    if len(bound) != _EXPERT_ARGS or not all(isinstance(t, torch.Tensor) for t in found):
        raise TypeError(f"a tiled {type(target.module).__name__} takes exactly {params} "
                        f"(tensors), got {sorted(bound)}; disable tiling for this call.")
    return found  # type: ignore[return-value]
