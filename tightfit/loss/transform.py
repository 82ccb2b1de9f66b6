"""Elementwise transforms some architectures apply to the logits before the loss.

Gemma 2 (and Gemma 3/4, VaultGemma, ...) soft-caps its logits, ``cap * tanh(z / cap)``;
Cohere multiplies them by ``logit_scale``; Granite divides them by ``logits_scaling``. Each
acts on one logit at a time, so a chunk of tokens can apply it to its own logits: the chunked
loss computes the same function as the model's unchunked head. The in-place versions here keep
the chunked loss at one fp32 buffer per chunk (plus one more for the soft-cap's derivative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class LogitTransform:
    """``softcap * tanh(scale * z / softcap)``, or ``scale * z`` without a soft-cap.

    Attributes:
        scale: Factor on the logits first (Cohere's ``logit_scale``; Granite's is
            ``1 / logits_scaling``).
        softcap: The cap of ``cap * tanh(z / cap)`` (Gemma 2's ``final_logit_softcapping``),
            or ``None``.
    """

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"logit scale must be a positive finite number, got {self.scale!r}.")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(
                f"logit softcap must be a positive finite number or None, got {self.softcap!r}."
            )

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: Tensor) -> Tensor:
        """Out of place, for autograd (the recompute strategy, forward-only passes)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = (z / self.softcap).tanh() * self.softcap
        return z

    def apply_(self, z: Tensor) -> Tensor | None:
        """Transform fp32 logits ``z`` in place; returns what :meth:`grad_` needs (the
        soft-cap's ``1 - tanh^2``, one more buffer like ``z``) or ``None``."""
        if self.softcap is None:
            if self.scale != 1.0:
                z.mul_(self.scale)
            return None
        t = z.mul_(self.scale / self.softcap).tanh()
        z.copy_(t).mul_(self.softcap)
        return t.square_().neg_().add_(1.0)  # d(cap * tanh(s z / cap)) / dz = s (1 - t^2)

    def grad_(self, g: Tensor, saved: Tensor | None) -> None:
        """Turn ``g``, the gradient w.r.t. the transformed logits, into the gradient w.r.t.
        the raw logits, in place."""
        if saved is not None:
            g.mul_(saved)
        if self.scale != 1.0:
            g.mul_(self.scale)
