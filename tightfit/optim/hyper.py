"""Hyperparameter checks shared by the paged optimizers' ``_check_group``, and the kernel a
group's ``foreach``/``fused`` flags select.

Each check raises where torch's optimizer raises, with torch's exception type and words, then
the fix (``example`` is the value the message suggests: Lion wants ``betas=(0.9, 0.99)``, SGD
``lr=0.01``), before any state changes.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

try:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as _fused_devices
except ImportError:  # pragma: no cover - older torch
    _fused_devices = None

Impl = Literal["fused", "foreach", "forloop"]


def check_lr(lr: Any, example: str = "1e-4", group: dict[str, Any] | None = None) -> None:
    """``lr`` is a number or one-element tensor, >= 0 (NaN rejected); a Tensor ``lr`` cannot
    go with ``foreach=True`` (torch's foreach kernels take it as a number)."""
    if isinstance(lr, torch.Tensor):
        if group is not None and group.get("foreach") and not group.get("capturable"):
            raise ValueError(
                "lr as a Tensor is not supported for capturable=False and foreach=True; pass "
                "a float lr, or foreach=None (a Tensor lr works with the default kernels)"
            )
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element; pass a float or a 0-dim tensor")
    if not float(lr) >= 0.0:  # also rejects NaN
        raise ValueError(
            f"Invalid learning rate: {float(lr)}; pass a learning rate >= 0 (e.g. {example})"
        )


def check_betas(
    betas: Any, pair: str = "(0.9, 0.999)", keyword: bool = True,
    group: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """``betas`` is a pair, each in [0, 1), both numbers or both one-element tensors;
    ``pair`` is the suggested value (``keyword`` writes it as ``betas=<pair>``)."""
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise TypeError(f"betas={betas!r} must be a pair (beta1, beta2), e.g. {pair}")
    suggestion = f"betas={pair}" if keyword else pair
    tensors = [isinstance(b, torch.Tensor) for b in betas]
    if tensors[0] != tensors[1]:
        raise ValueError(
            f"betas must be either both floats or both Tensors; got {betas!r}: pass e.g. "
            f"{suggestion}"
        )
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor):
            if group is not None and group.get("foreach") and not group.get("capturable"):
                raise ValueError(
                    f"betas[{i}] as a Tensor is not supported for capturable=False and "
                    "foreach=True; pass float betas, or foreach=None"
                )
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element; pass e.g. {suggestion}")
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(
                f"Invalid beta parameter at index {i}: {float(b)}; each beta must be in "
                f"[0, 1): pass e.g. {suggestion}"
            )


def check_eps(eps: float) -> None:
    """``eps`` >= 0 (torch's rule; NaN rejected)."""
    if not float(eps) >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}; pass eps >= 0 (e.g. 1e-8)")


def check_nonnegative(name: str, value: float, example: str) -> None:
    """``value`` >= 0 (``weight_decay``, ``momentum``); NaN rejected."""
    if not float(value) >= 0.0:
        raise ValueError(f"Invalid {name} value: {value}; pass {name} >= 0 (e.g. {example})")


def check_graph_flags(group: dict[str, Any], torch_class: str, fused_kernel: bool = True) -> None:
    """torch's flags: paged state cannot be captured in a CUDA graph (``capturable``) nor
    differentiated through (``differentiable``); ``fused`` and ``foreach`` exclude each other
    (torch's own rule, its ``RuntimeError``); ``fused=True`` needs a fused kernel to exist
    (``fused_kernel``)."""
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported by paged optimizers (pages move between "
                f"tiers outside any graph); pass {flag}=False or use {torch_class}"
            )
    if group.get("fused") and group.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together; pass one of them")
    if group.get("fused") and not fused_kernel:
        raise ValueError(
            f"fused=True: torch has no fused kernel for this optimizer ({torch_class} runs "
            "torch's foreach kernels); pass fused=None or fused=False"
        )


def fused_supported(device: torch.device) -> bool:
    """Whether torch's fused optimizer kernels run on ``device``'s type."""
    if _fused_devices is None:  # pragma: no cover - older torch
        return device.type == "cuda"
    return device.type in _fused_devices()


def implementation(group: dict[str, Any], device: torch.device) -> Impl:
    """The kernel family a group's flags ask for: ``fused=True`` → fused; ``foreach=True`` →
    foreach; ``foreach=False`` (fused not ``True``) → torch's single-tensor loop; neither
    set → fused where the device has it (torch picks foreach on CUDA and the loop on the CPU;
    the fused kernel does the same math faster), else foreach; ``fused=False`` alone →
    foreach."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if foreach is not None:
        return "forloop"
    if fused is None and fused_supported(device):
        return "fused"
    return "foreach"


def scalar(value: Any) -> float:
    """A hyperparameter as a Python number (a one-element tensor's value)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
