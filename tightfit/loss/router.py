"""The load-balancing loss a MoE causal LM adds to its LM loss, for the chunked forward.

Mixtral, Qwen3-MoE, gpt-oss and most other transformers MoE models add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, mask)``
to the loss when ``output_router_logits`` is on (an argument, or the config's default). The
chunked forward replaces the model's forward, so it must add the same term with the model's
own function, or refuse where the model computes it some other way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

# the standard signature (25+ families); others (grouped routers, encoder-decoder) differ
_PARAMS = ["gate_logits", "num_experts", "top_k", "attention_mask"]


@dataclass(frozen=True)
class RouterLoss:
    """How a MoE causal LM computes its router loss: ``func`` is its module's
    ``load_balancing_loss_func`` (``None``: computed some other way, not supported)."""

    model: str
    func: Callable[..., Tensor] | None

    def wanted(self, lm: nn.Module, arguments: dict[str, Any]) -> bool:
        """Whether this call asks for router logits (HF: the argument, else the config);
        raises when it does and the model's router loss is not supported."""
        want = arguments.get("output_router_logits")
        if want is None:
            want = bool(getattr(lm.config, "output_router_logits", False))
        if want and self.func is None:
            raise ValueError(_unsupported(self.model))
        return bool(want)

    def add(
        self, lm: nn.Module, loss: Tensor, outputs: Any, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(loss + coef * aux, aux)``, as the model's own forward computes them."""
        if self.func is None:
            raise ValueError(_unsupported(self.model))
        aux = self.func(outputs.router_logits, lm.num_experts, lm.num_experts_per_tok,
                        attention_mask)
        return loss + lm.router_aux_loss_coef * aux.to(loss.device), aux


def router_loss_of(lm: nn.Module, signature: inspect.Signature) -> RouterLoss | None:
    """The router loss of ``lm`` (``None``: not a MoE model, its forward has no
    ``output_router_logits``).

    Raises:
        ValueError: The config turns router logits on and the model computes its router
            loss in a way the chunked forward does not reproduce.
    """
    if "output_router_logits" not in signature.parameters:
        return None
    func = getattr(inspect.getmodule(type(lm)), "load_balancing_loss_func", None)
    ok = (
        callable(func)
        and list(inspect.signature(func).parameters)[:4] == _PARAMS
        and all(hasattr(lm, a) for a in ("num_experts", "num_experts_per_tok",
                                          "router_aux_loss_coef"))
    )
    found = RouterLoss(type(lm).__name__, func if ok else None)
    if not ok and getattr(lm.config, "output_router_logits", False):
        raise ValueError(_unsupported(found.model))
    return found


def _unsupported(model: str) -> str:
    return (
        f"{model} adds a router loss that the chunked loss does not know how to compute "
        "(not transformers' load_balancing_loss_func(router_logits, num_experts, top_k, "
        "attention_mask)); set output_router_logits=False or leave chunked loss off."
    )
