"""What a (tiled) Llama-family MLP allocates in one forward + backward, predicted from shapes
(a tiled Phi-3 fused ``gate_up_proj`` MLP too: ``fused=True``; MoE experts are not modelled
here: the planner counts them, :mod:`tightfit.planner.moe`).

The figures are what :class:`~tightfit.measure.tracker.MemoryTracker` counts around
``y = mlp(x); y.backward(g)``: bytes above the input, its gradient and the weights, with the
output kept until backward (a decoder layer's residual add makes a tensor of that size anyway)
and the parameter gradients included. A planner adds them to what the rest of a layer costs to
choose ``tile_tokens`` (:func:`tightfit.checkpoint.tiling.enable_tiling`).

Where the bytes are, ``N`` tokens of width ``H``, intermediate ``I``, LoRA rank ``r``, ``d``
bytes per element of the compute dtype, ``t`` tokens per tile:

* **untiled**: forward saves the gate and up outputs, the activation and the product
  (``N × I`` each; in fp32 ``16·N·I`` bytes), with LoRA also the adapters' ``N × r`` inputs
  and with dropout the masks; backward adds their gradients on top.
* **tiled**: nothing is saved but the input; forward holds the output (``N·H·d``) and one
  tile's intermediates; backward holds the output, the input gradient (``N·H·d``) and one
  recomputed tile with its gradients, plus an fp32 accumulator per trainable parameter (from
  the second tile on). The first tile runs before the output (forward) or the accumulators
  (backward) exist, so the peak is the larger of "first tile" and "a later tile".
* **4-bit base** (bitsandbytes ``Linear4bit``): as a frozen base, plus a moment in backward
  when one projection's dequantized weight (``H × I``: 4 bytes, plus ``d`` when it is cast
  to a 16-bit compute dtype) is alive beside the tile's tensors.

The per-tensor counts (bytes per ``t × I`` and per ``t × H`` element) depend on how peft,
torch and bitsandbytes compute each piece, so they are measured on this stack: fitted on a
grid of shapes (H 64/128, I 224/352, r 4/16, N 256/384, tiles 32–128) and checked on other
shapes in ``tests/checkpoint/test_tiling.py`` (within 10 %; 4 % seen). LoRA adapters are
fp32 (tightfit's and peft's QLoRA default) on every projection; the compute dtype is fp32 or
a 16-bit one. Tiles under 32 tokens are not in the fit: there fixed terms dominate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Base = Literal["trainable", "frozen", "4bit"]

# (base, lora, dropout, dtype bytes) -> bytes per element of each shape; "P" is the number of
# trainable parameters (LoRA factors, or the three projections of a trained base).
_Kind = tuple[str, bool, bool, int]
# One tile in forward: (t·I, t·H).
_TILE_FWD: dict[_Kind, tuple[float, float]] = {
    ("trainable", False, False, 4): (12, 0), ("trainable", False, False, 2): (6, 0),
    ("frozen", False, False, 4): (12, 0), ("frozen", False, False, 2): (6, 0),
    ("frozen", True, False, 4): (16, 0), ("frozen", True, False, 2): (12, 4),
    ("frozen", True, True, 4): (16, 0), ("frozen", True, True, 2): (14, 2),
}
# A recomputed tile and its backward, from the second tile on: (t·I, t·H, P).
_TILE_BWD: dict[_Kind, tuple[float, float, float]] = {
    ("trainable", False, False, 4): (22.5, 0.5, 6.25),
    ("trainable", False, False, 2): (11.25, 0.25, 5.25),
    ("frozen", False, False, 4): (24, 4, 0), ("frozen", False, False, 2): (12, 2, 0),
    ("frozen", True, False, 4): (24, 4.25, 5.75), ("frozen", True, False, 2): (13.75, 14, 5.5),
    ("frozen", True, True, 4): (24.25, 28.25, 4.5), ("frozen", True, True, 2): (20.25, 26.25, 4.5),
}
# A 4-bit base's moment with a dequantized weight alive, beside it: (t·I, t·H, P).
_DEQUANT_BWD: dict[tuple[bool, bool, int], tuple[float, float, float]] = {
    (False, False, 4): (16, 4, 0), (False, False, 2): (6, 2, 0),
    (True, False, 4): (20, 4.25, 5.5), (True, False, 2): (8, 12.5, 5.5),
    (True, True, 4): (20, 20.25, 5.5), (True, True, 2): (8, 20.25, 5.5),
}
# Untiled forward peak (N·I, N·H); backward peak (N·I, N·H, P); saved for backward besides
# the input and the output (N·I, N·H, N·r).
_UNTILED_FWD: dict[_Kind, tuple[float, float]] = {
    ("trainable", False, False, 4): (16, 4), ("trainable", False, False, 2): (8, 2),
    ("frozen", False, False, 4): (16, 4), ("frozen", False, False, 2): (8, 2),
    ("frozen", True, False, 4): (18.5, 7.25), ("frozen", True, False, 2): (12.25, 18.25),
    ("frozen", True, True, 4): (24.25, 28.25), ("frozen", True, True, 2): (20.25, 26.25),
}
_UNTILED_BWD: dict[_Kind, tuple[float, float, float]] = {
    ("trainable", False, False, 4): (24, 4, 1.25), ("trainable", False, False, 2): (12, 2, 0.75),
    ("frozen", False, False, 4): (24, 4, 0), ("frozen", False, False, 2): (12, 2, 0),
    ("frozen", True, False, 4): (24, 4, 3.25), ("frozen", True, False, 2): (13.75, 13, 4),
    ("frozen", True, True, 4): (24, 20, 4.25), ("frozen", True, True, 2): (17.75, 21, 4),
}
_UNTILED_SAVED: dict[_Kind, tuple[float, float, float]] = {
    ("trainable", False, False, 4): (16, 0, 0), ("trainable", False, False, 2): (8, 0, 0),
    ("frozen", False, False, 4): (12, 0, 0), ("frozen", False, False, 2): (6, 0, 0),
    ("frozen", True, False, 4): (16, 0, 12), ("frozen", True, False, 2): (10, 8, 12),
    ("frozen", True, True, 4): (20, 16, 12), ("frozen", True, True, 2): (14, 16, 12),
}
# Phi-3's fused MLP (one gate_up_proj, its output split into gate and up), tiled: the fused
# output stays alive while the activation and the product are made, and the 4-bit moment
# dequantizes gate_up (H × 2I). Fitted on the same kind of grid (H 64/128, I 224/352, N
# 256/384, tiles 64-128; the 4-bit moment on H 192/256, I 384/512, tiles 32-64); untiled
# fused MLPs are not modelled.
_FUSED_TILE_FWD: dict[_Kind, tuple[float, float]] = {
    ("trainable", False, False, 4): (16, 0), ("trainable", False, False, 2): (8, 0),
    ("frozen", False, False, 4): (16, 0), ("frozen", False, False, 2): (8, 0),
    ("frozen", True, False, 4): (24, 0), ("frozen", True, False, 2): (20, 4),
    ("frozen", True, True, 4): (24, 0), ("frozen", True, True, 2): (20, 4),
}
_FUSED_TILE_BWD: dict[_Kind, tuple[float, float, float]] = {
    ("trainable", False, False, 4): (23.75, 5.25, 5.75),
    ("trainable", False, False, 2): (12, 2.5, 4.75),
    ("frozen", False, False, 4): (24, 8, 0), ("frozen", False, False, 2): (12, 4, 0),
    ("frozen", True, False, 4): (24, 8.25, 5.5), ("frozen", True, False, 2): (20, 8.25, 5.5),
    ("frozen", True, True, 4): (24.25, 24.25, 4), ("frozen", True, True, 2): (20.25, 20.25, 4),
}
_FUSED_DEQUANT_BWD: dict[tuple[bool, bool, int], tuple[float, float, float]] = {
    (False, False, 4): (8, 12, 0), (False, False, 2): (4, 4, 0),
    (True, False, 4): (8, 16, 8), (True, False, 2): (4, 6, 8),
    (True, True, 4): (8, 16, 8), (True, True, 2): (4, 6, 8),
}
_ACCUMULATOR = 4  # fp32 bytes per trainable parameter, summing tile grads from the 2nd tile
_DEQUANT_FP32 = 4  # bitsandbytes dequantizes to fp32 (the weights' dtype when quantized)


@dataclass(frozen=True)
class MLPBytes:
    """Predicted bytes of one MLP forward + backward (see the module docstring).

    Attributes:
        saved_bytes: Kept from forward to backward besides the input (0 when tiled).
        forward_peak_bytes: Peak during forward (the output included).
        backward_peak_bytes: Peak during backward (output, input grad, param grads included).
    """

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """The larger of the two peaks."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


def lora_params(hidden: int, intermediate: int, rank: int, *, fused: bool = False) -> int:
    """Elements of rank-``rank`` LoRA factors on gate, up and down: ``3·r·(H + I)``; on a
    fused gate_up and down: ``r·(2H + 3I)``."""
    if fused:
        return rank * (2 * hidden + 3 * intermediate)
    return 3 * rank * (hidden + intermediate)


def _check(tokens: int, hidden: int, intermediate: int, tile: int | None, dtype: torch.dtype,
           lora_rank: int, lora_dropout: float, base: str) -> None:
    for name, v in (("tokens", tokens), ("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile must be a positive int (tokens) or None (untiled), got {tile!r}.")
    if not isinstance(dtype, torch.dtype) or dtype.itemsize not in (2, 4) or \
            not dtype.is_floating_point:
        raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, got {dtype!r}.")
    if base not in ("trainable", "frozen", "4bit"):
        raise ValueError(f"base must be 'trainable', 'frozen' or '4bit', got {base!r}.")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int ≥ 0 (0: no LoRA), got {lora_rank!r}.")
    if base == "trainable" and lora_rank:
        raise ValueError("base='trainable' trains the projections themselves; LoRA on a "
                         "trained base is not modelled. Pass base='frozen' (or '4bit') with "
                         "lora_rank, or lora_rank=0.")
    if not 0.0 <= lora_dropout < 1.0 or (lora_dropout and not lora_rank):
        raise ValueError(f"lora_dropout must be in [0, 1) and needs lora_rank > 0, got "
                         f"{lora_dropout!r} with lora_rank={lora_rank}.")


def predict_mlp_bytes(tokens: int, hidden: int, intermediate: int, dtype: torch.dtype, *,
                      tile: int | None = None, lora_rank: int = 0, lora_dropout: float = 0.0,
                      base: Base = "frozen", fused: bool = False) -> MLPBytes:
    """Predict the bytes one MLP forward + backward allocates, tiled or not.

    Args:
        tokens: Tokens in the batch (``batch × seq``).
        hidden: The MLP's input width (``hidden_size``).
        intermediate: Its inner width (``intermediate_size``).
        dtype: Compute dtype of the activations (and of a trained base's weights).
        tile: Tokens per tile, or ``None`` for the plain (untiled) MLP.
        lora_rank: Rank of fp32 LoRA adapters on gate, up and down (0: none).
        lora_dropout: The adapters' dropout probability.
        base: ``"trainable"`` (the projections are trained), ``"frozen"`` or ``"4bit"``
            (frozen bitsandbytes NF4/FP4 weights).
        fused: Phi-3's MLP (one ``gate_up_proj`` of ``2I`` outputs and ``down_proj``,
            :mod:`tightfit.checkpoint.mlp_kinds`), tiled only.

    Raises:
        ValueError: A shape, dtype or option out of range, or a combination not modelled.
    """
    _check(tokens, hidden, intermediate, tile, dtype, lora_rank, lora_dropout, base)
    if fused and tile is None:
        raise ValueError("an untiled fused gate_up MLP is not modelled; pass tile=<tokens> "
                         "(a tiled one is) or fused=False for a gate/up/down MLP.")
    d = dtype.itemsize
    kind = ("trainable" if base == "trainable" else "frozen", lora_rank > 0, lora_dropout > 0, d)
    n, h, i = tokens, hidden, intermediate
    params = 3 * h * i if base == "trainable" else lora_params(h, i, lora_rank, fused=fused)
    if tile is None:
        f_i, f_h = _UNTILED_FWD[kind]
        b_i, b_h, b_p = _UNTILED_BWD[kind]
        s_i, s_h, s_r = _UNTILED_SAVED[kind]
        return MLPBytes(math.ceil(n * (s_i * i + s_h * h + s_r * lora_rank)),
                        math.ceil(n * (f_i * i + f_h * h)),
                        math.ceil(n * (b_i * i + b_h * h) + b_p * params))
    first = min(tile, n)
    later = min(tile, n - tile)  # the largest tile after the first (≤ 0: there is none)
    f_i, f_h = (_FUSED_TILE_FWD if fused else _TILE_FWD)[kind]
    forward = first * (f_i * i + f_h * h)  # the first tile runs before the output exists
    if later > 0:
        forward = max(forward, n * h * d + later * (f_i * i + f_h * h))
    backward = _tile_backward(kind, base, first, h, i, params, fused) - _ACCUMULATOR * params
    if later > 0:
        backward = max(backward, _tile_backward(kind, base, later, h, i, params, fused))
    return MLPBytes(0, math.ceil(forward), math.ceil(2 * n * h * d + backward))


def _tile_backward(kind: _Kind, base: str, t: int, h: int, i: int, params: int,
                   fused: bool = False) -> float:
    """One recomputed tile of ``t`` tokens and its backward, accumulators included."""
    b_i, b_h, b_p = (_FUSED_TILE_BWD if fused else _TILE_BWD)[kind]
    peak = t * (b_i * i + b_h * h) + b_p * params
    if base == "4bit":
        d = kind[3]
        q_i, q_h, q_p = (_FUSED_DEQUANT_BWD if fused else _DEQUANT_BWD)[kind[1:]]
        # the largest weight dequantized: gate_up's H × 2I when fused, else one H × I
        dequant = (2 if fused else 1) * h * i * (_DEQUANT_FP32 + (d if d != _DEQUANT_FP32 else 0))
        peak = max(peak, dequant + t * (q_i * i + q_h * h) + q_p * params)
    return peak
