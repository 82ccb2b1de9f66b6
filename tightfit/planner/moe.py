"""What a mixture-of-experts layer saves and holds in backward (Mixtral, Qwen3-MoE).

Each token goes to its top-k experts, so an MoE MLP works on T·k routed (token, slot) pairs;
what it saves scales with the pairs, not with the number of experts E. Counted from the two
forwards (tightfit's 4-bit experts, :mod:`tightfit.qlora.experts`, and transformers' own for
unquantized experts with peft's parameter LoRA), with the tensors autograd saves listed on
small configs; the few bytes per token and per pair of routing indices were fitted there.
Symbols: P = T·k pairs, I an expert's intermediate size, h hidden, d / a bytes of the compute
/ adapter dtype, r the LoRA rank.

* 4-bit experts, per pair: the gate/up output (2I), its activation (I) and the down
  projection's input (I) and output (h) and the gathered input (h): (3I + 2h)·d, plus
  ``ROUTE_PAIR`` bytes of indices; a LoRA on an expert weight adds its input in the adapter
  dtype and its r-wide hidden, (h + r)·a for gate/up and (I + r)·a for down.
* unquantized experts, per pair: (3I + h)·d (a frozen full-precision matmul keeps no input);
  with a LoRA, peft's ``ParamWrapper`` adds the adapter to the weight itself, so every
  expert's merged weight is saved (E·in·out·d per adapted weight) and the inputs too.
* the router: its fp32 softmax over E experts (4·E per token) and ``ROUTE_TOKEN`` bytes per
  token of top-k values and indices.
* backward: one expert's projection dequantized (in·out·d) beside its tokens' gradients.
  How many tokens one expert gets depends on the data; the planner assumes the worst case,
  all T tokens at one expert (top-k experts are distinct, so no more than T).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tightfit.planner.setup import TrainSetup
    from tightfit.planner.shapes import ModelShape

# Fitted on small Mixtral configs (fp32 and bf16, k = 2 and 3, E = 4 and 8; the list of
# saved tensors: int64 sort order and token / slot indices, top-k values): bytes per pair and
# per token beside the counted terms. Held out: tests/planner/test_families.py.
ROUTE_PAIR = 32
ROUTE_TOKEN = 68


def expert_saved_bytes(shape: ModelShape, setup: TrainSetup, tokens: int) -> int:
    """What one MoE MLP (experts + router) saves for ``tokens`` tokens."""
    h, i, d, a, r = shape.hidden, shape.intermediate, setup.d, setup.a, setup.lora_r
    pairs = tokens * shape.experts_per_token
    total = tokens * (4 * shape.experts + ROUTE_TOKEN) + pairs * ROUTE_PAIR
    gate_up, down = setup.adapts("gate_up_proj"), setup.adapts("down_proj")
    if setup.quant == "none":
        total += pairs * (3 * i + h) * d
        for adapted, width, numel in ((gate_up, h, 2 * h * i), (down, i, h * i)):
            if adapted:  # ParamWrapper: the merged weights and the input are saved
                total += pairs * width * d + shape.experts * numel * d
        return total
    total += pairs * (3 * i + 2 * h) * d
    if gate_up:
        total += pairs * (h + r) * a
    if down:
        total += pairs * (i + r) * a
    return total


def expert_backward_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """One expert's backward with all T tokens routed to it (the worst case).

    4-bit: its gate/up projection dequantized (2I·h·d) beside its intermediate's gradient
    (T·I·d) and, with LoRA on the experts, the adapters' input gradients in the adapter
    dtype (T·(h + I)·a). Unquantized with peft's parameter LoRA: the gradient of one merged
    expert weight stack (E·I·h·d) and two intermediate gradients. Measured with every token
    at the same experts (``tightfit plan --verify`` zeroes the routers); the attention's
    backward (:func:`tightfit.planner.activations.attention_backward_bytes`) is the other
    moment of a MoE layer.
    """
    t, h, i, d = setup.tokens, shape.hidden, shape.intermediate, setup.d
    lora = setup.adapts("gate_up_proj") or setup.adapts("down_proj")
    if setup.quant == "none":
        return (shape.experts * i * h * d + 2 * t * i * d) if lora else t * i * d
    return 2 * i * h * d + t * i * d + (t * (h + i) * setup.a if lora else 0)
