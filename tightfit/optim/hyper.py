"""Hyperparameter checks shared by the paged optimizers' ``_check_group``.

Each check raises a ``ValueError``/``TypeError`` naming the bad value and the fix, before any
state changes; ``example`` is the value the message suggests (it differs per optimizer: Lion
wants ``betas=(0.9, 0.99)``, SGD ``lr=0.01``).
"""

from __future__ import annotations

from typing import Any

import torch


def check_lr(lr: float | torch.Tensor, example: str = "1e-4") -> None:
    """``lr`` is a float or one-element tensor, >= 0 (NaN rejected)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("lr as a Tensor must have one element; pass a float or a 0-dim tensor")
    if not float(lr) >= 0.0:  # also rejects NaN
        raise ValueError(f"lr={float(lr)} is negative; pass a learning rate >= 0 (e.g. {example})")


def check_betas(betas: Any, pair: str = "(0.9, 0.999)", keyword: bool = True) -> None:
    """``betas`` is a pair, each in [0, 1); ``pair`` is the suggested value.

    ``keyword`` writes the suggestion as ``betas=<pair>`` (else the bare pair).
    """
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise TypeError(f"betas={betas!r} must be a pair (beta1, beta2), e.g. {pair}")
    suggestion = f"betas={pair}" if keyword else pair
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}]={float(b)} is outside [0, 1); pass e.g. {suggestion}")


def check_eps(eps: float) -> None:
    """``eps`` > 0."""
    if not float(eps) > 0.0:
        raise ValueError(f"eps={eps} must be > 0 (it keeps the update finite); e.g. 1e-8")


def check_nonnegative(name: str, value: float, example: str) -> None:
    """``value`` >= 0 (``weight_decay``, ``momentum``); NaN rejected."""
    if not float(value) >= 0.0:
        raise ValueError(f"{name}={value} is negative; pass a value >= 0 (e.g. {example})")


def check_graph_flags(group: dict[str, Any], torch_class: str) -> None:
    """Paged state cannot be captured in a CUDA graph or differentiated through; fused and
    foreach exclude each other (torch's own rule)."""
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported by paged optimizers (pages move between "
                f"tiers outside any graph); pass {flag}=False or use {torch_class}"
            )
    if group.get("fused") and group.get("foreach"):
        raise ValueError("fused=True and foreach=True exclude each other; pass one of them")
