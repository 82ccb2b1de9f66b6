"""A long example's profile from shorter crops of it, without running the long step unchecked.

:func:`~tightfit.checkpoint.profile.profile` runs the example once without any checkpointing:
at long context that is exactly the step that does not fit (the reason to plan at all). So a
long example is profiled on two *crops* of it — its first ``t1`` and ``t2`` tokens per
sequence — and every figure is carried to the full length:

* **bytes** are affine in the tokens of the step: activations are ``tokens × width`` (SDPA's
  attention included: no ``T × T`` tensor without padding, see ``docs/checkpoint.md``), and
  what does not grow — a dequantized 4-bit weight, a loss chunk, one MLP tile, the LoRA
  gradients — is a constant. The line through the two crops is exact when the same terms are
  the largest at both crops and at the full length, so the crops must hold at least one loss
  chunk and two MLP tiles (the callers size them so) and be long enough that per-token terms
  dominate; a ``B × 1 × T × T`` padding mask grows quadratically and is not modelled;
* **times** (they only rank plans against each other) are fitted ``a·T + b·T²`` through the
  two crops, both coefficients ≥ 0: attention grows quadratically, the rest linearly.

Storage sizes (``BlockCost.saved_sizes``, what offload moves) are carried one by one when both
crops saved the same number of storages, else scaled with the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from tightfit.checkpoint.chain import BlockCost, Profile
from tightfit.checkpoint.profile import profile

_TIMES = ("forward_s", "selective_forward_s")
_FLAGS = ("saves_input", "saved_tensors", "saved_sizes")


def example_length(example: Mapping[str, Any] | torch.Tensor) -> int:
    """Tokens per sequence of ``example`` (``input_ids``' or the tensor's last dimension)."""
    ids = example.get("input_ids") if isinstance(example, Mapping) else example
    if not isinstance(ids, torch.Tensor) or ids.dim() < 1:
        raise ValueError("the example needs an input_ids tensor (batch × sequence) to be cropped.")
    return int(ids.shape[-1])


def crop(example: Mapping[str, Any] | torch.Tensor, length: int) -> Any:
    """The first ``length`` tokens of every sequence of ``example`` (views, nothing copied).

    Tensors whose last dimension is the sequence are cut there (``input_ids``, ``labels``,
    ``attention_mask``, ``position_ids``); a 4-D ``… × T × T`` mask in its last two.
    """
    full = example_length(example)
    if not 1 <= length <= full:
        raise ValueError(f"crop length must be in 1..{full} tokens, got {length}.")

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[-1] != full:
            return t
        if t.dim() == 4 and t.shape[-2] == full:
            return t[..., :length, :length]
        return t[..., :length]

    if isinstance(example, Mapping):
        return {k: cut(v) for k, v in example.items()}
    return cut(example)


def _affine(v1: float, v2: float, t1: int, t2: int, t: int) -> int:
    return max(0, math.ceil(v2 + (v2 - v1) * (t - t2) / (t2 - t1)))


def _time(v1: float, v2: float, t1: int, t2: int, t: int) -> float:
    """``a·t + b·t²`` through ``(t1, v1)`` and ``(t2, v2)`` with ``a, b ≥ 0``."""
    b = (v2 / t2 - v1 / t1) / (t2 - t1)
    a = v1 / t1 - b * t1
    if b < 0:
        a, b = v2 / t2, 0.0
    elif a < 0:
        a, b = 0.0, v2 / t2**2
    return max(0.0, a * t + b * t * t)


def _sizes(s1: tuple[int, ...] | None, s2: tuple[int, ...] | None, t1: int, t2: int,
           t: int) -> tuple[int, ...] | None:
    if s2 is None:
        return None
    if s1 is not None and len(s1) == len(s2):
        return tuple(sorted((_affine(a, b, t1, t2, t) for a, b in zip(s1, s2)), reverse=True))
    return tuple(math.ceil(n * t / t2) for n in s2)


def _block(b1: BlockCost, b2: BlockCost, t1: int, t2: int, t: int) -> BlockCost:
    out: dict[str, Any] = {}
    for f in fields(BlockCost):
        v1, v2 = getattr(b1, f.name), getattr(b2, f.name)
        if f.name in _TIMES:
            out[f.name] = _time(v1, v2, t1, t2, t)
        elif f.name == "saved_sizes":
            out[f.name] = _sizes(v1, v2, t1, t2, t)
        elif f.name in _FLAGS:
            out[f.name] = v2
        else:
            out[f.name] = _affine(v1, v2, t1, t2, t)
    return BlockCost(**out)


def extrapolate(p1: Profile, t1: int, p2: Profile, t2: int, t: int) -> Profile:
    """The profile at ``t`` tokens per sequence from profiles at ``t1 < t2`` (see the module).

    Raises:
        ValueError: The lengths are not increasing, or the profiles have different chains.
    """
    if not 0 < t1 < t2:
        raise ValueError(f"extrapolate needs crops of 0 < t1 < t2 tokens, got {t1} and {t2}.")
    if len(p1.blocks) != len(p2.blocks):
        raise ValueError(f"the crops' profiles have {len(p1.blocks)} and {len(p2.blocks)} "
                         "blocks; profile the same model and blocks twice.")
    blocks = tuple(_block(a, b, t1, t2, t) for a, b in zip(p1.blocks, p2.blocks))
    return replace(
        p2, blocks=blocks,
        prefix_peak_bytes=_affine(p1.prefix_peak_bytes, p2.prefix_peak_bytes, t1, t2, t),
        tail_peak_bytes=_affine(p1.tail_peak_bytes, p2.tail_peak_bytes, t1, t2, t),
        tail_saved_bytes=_affine(p1.tail_saved_bytes, p2.tail_saved_bytes, t1, t2, t),
        peak_bytes=_affine(p1.peak_bytes, p2.peak_bytes, t1, t2, t),
        frame_bytes=_affine(p1.frame_bytes, p2.frame_bytes, t1, t2, t),
        tail_forward_s=_time(p1.tail_forward_s, p2.tail_forward_s, t1, t2, t),
        step_s=_time(p1.step_s, p2.step_s, t1, t2, t),
    )


def profile_from_crops(model: nn.Module, example: Mapping[str, Any] | torch.Tensor,
                       lengths: tuple[int, int], *, blocks: Sequence[nn.Module] | None = None,
                       ) -> Profile:
    """:func:`profile` of ``example`` at its full length, from its crops of ``lengths``
    tokens per sequence (two profiles of the short crops; nothing runs at the full length).

    Raises:
        ValueError: Bad lengths (they must be ``0 < t1 < t2`` and at most the example's), or
            an example the model cannot run.
    """
    t1, t2 = lengths
    full = example_length(example)
    if not 0 < t1 < t2 <= full:
        raise ValueError(f"crop lengths must be 0 < t1 < t2 <= {full} tokens, got {lengths}.")
    p1 = profile(model, crop(example, t1), blocks=blocks)
    p2 = profile(model, crop(example, t2), blocks=blocks)
    return extrapolate(p1, t1, p2, t2, full)
