"""A prepared model's state dict loads back: each 4-bit layer takes its saved quant state.

bitsandbytes' ``Linear4bit`` saves its quantization constants next to its packed weight
(``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4``) but never reads them
back, so ``model.load_state_dict(model.state_dict())`` — what accelerate's ``load_state`` does
with the model it prepared — fails with ``Unexpected key(s) ... weight.absmax`` (a plain HF
bnb-4bit + peft model fails the same way). :func:`take_saved_quant_state` gives a layer a
load-state-dict pre hook that takes those keys out of the state dict and installs the saved
quant state with the saved packed weight, so the layer loads exactly, strict loading included;
:func:`tightfit.prepare` installs it on every 4-bit layer it makes.
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
from bitsandbytes.functional import QuantState
from torch import nn

_MARK = "_tightfit_takes_quant_state"


def take_saved_quant_state(layer: nn.Module) -> None:
    """Make ``layer`` (a bitsandbytes ``Linear4bit``) load the quant state saved with its
    weight (idempotent)."""
    if not isinstance(layer, bnb.nn.Linear4bit):
        raise TypeError(f"expected a bitsandbytes Linear4bit, got {type(layer).__name__}")
    if not getattr(layer, _MARK, False):
        layer.register_load_state_dict_pre_hook(_load_quant_state)
        setattr(layer, _MARK, True)


def _load_quant_state(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    base = prefix + "weight."
    keys = [k for k in state_dict if k.startswith(base)]
    if not keys:
        return  # a state dict without the constants: the layer keeps its own
    saved = {k[len(base) :]: state_dict.pop(k) for k in keys}
    weight = module.weight
    current = getattr(weight, "quant_state", None)
    try:
        state = QuantState.from_dict(saved, device=weight.device)
    except (KeyError, ValueError, RuntimeError) as exc:
        error_msgs.append(
            f"{prefix}weight: its saved 4-bit quant state cannot be read ({exc}); load a state "
            "dict saved from a model prepared with the same bitsandbytes version"
        )
        return
    if current is not None and (
        tuple(state.shape) != tuple(current.shape)
        or (state.quant_type, state.blocksize) != (current.quant_type, current.blocksize)
    ):
        error_msgs.append(
            f"{prefix}weight was saved as {state.quant_type} {tuple(state.shape)} (blocksize "
            f"{state.blocksize}) but this layer is {current.quant_type} {tuple(current.shape)} "
            f"(blocksize {current.blocksize}); prepare the model with the saved quantization "
            "settings"
        )
        return
    if current is not None and getattr(current, "packing_format_for_cpu", False):
        # bitsandbytes repacked the weight for its CPU kernel (an eval forward does that);
        # the saved weight is in the usual format: unpack first, as its own save does
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(
            weight.data, current
        )
    weight.quant_state = state  # the packed weight itself loads under the "weight" key
