"""``tightfit.optimizer_for``: the paged optimizer over a prepared model's trainable parameters."""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

OptimizerKind = Literal["paged_adamw", "paged_adamw8bit", "paged_lion", "paged_sgd", "adamw"]

# kind -> class name in tightfit.optim ("adamw" is torch's, the reference)
_PAGED = {
    "paged_adamw": "PagedAdamW",
    "paged_adamw8bit": "PagedAdamW8bit",
    "paged_lion": "PagedLion",
    "paged_sgd": "PagedSGD",
}


@dataclass(frozen=True)
class OptimizerOptions:
    """Which optimizer and how much of each memory tier its state may use."""

    kind: OptimizerKind = field(
        default="paged_adamw", metadata={"help": "optimizer: " + ", ".join([*_PAGED, "adamw"])}
    )
    lr: float = field(default=2e-3, metadata={"help": "learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay"})
    page_bytes: int | None = field(
        default=None, metadata={"help": "bytes per optimizer-state page (default: the pager's)"}
    )
    device_budget: int | None = field(
        default=None, metadata={"help": "bytes of optimizer state kept on the device tier"}
    )
    host_budget: int | None = field(
        default=None, metadata={"help": "bytes of optimizer state kept on the host tier"}
    )
    spill_dir: str | None = field(
        default=None, metadata={"help": "folder for the disk tier's spill file"}
    )

    def __post_init__(self) -> None:
        if self.kind not in (*_PAGED, "adamw"):
            raise ValueError(
                f"unknown optimizer kind {self.kind!r}; choose one of {[*_PAGED, 'adamw']}."
            )
        if self.lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}.")
        for name in ("page_bytes", "device_budget", "host_budget"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be a non-negative number of bytes, got {v}.")


def _find_class(name: str) -> type | None:
    """``tightfit.optim.<name>``, looked up in the package or its submodules."""
    import pkgutil

    pkg = importlib.import_module("tightfit.optim")
    cls = getattr(pkg, name, None)
    if cls is not None:
        return cls
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name in ("demo",):
            continue
        try:
            found = getattr(importlib.import_module(f"tightfit.optim.{mod.name}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients (LoRA adapters after :func:`tightfit.prepare`)."""
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_for(
    model: nn.Module,
    kind: OptimizerKind = "paged_adamw",
    *,
    lr: float = 2e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    page_bytes: int | None = None,
    device_budget: int | None = None,
    host_budget: int | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    **extra: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer over ``model``'s trainable parameters.

    Args:
        model: A prepared model (only parameters with ``requires_grad`` are optimized).
        kind: ``"paged_adamw"`` (default), ``"paged_adamw8bit"``, ``"paged_lion"``,
            ``"paged_sgd"``, or ``"adamw"`` (torch's AdamW, no paging: the reference).
        lr, weight_decay, betas, eps: The usual hyperparameters.
        page_bytes, device_budget, host_budget, spill_dir: Paging options (bytes); ignored
            by ``"adamw"``.
        **extra: Passed on to the optimizer class.

    Raises:
        ValueError: No trainable parameters, an unknown kind, bad budgets.
    """
    opts = OptimizerOptions(
        kind=kind,
        lr=lr,
        weight_decay=weight_decay,
        page_bytes=page_bytes,
        device_budget=device_budget,
        host_budget=host_budget,
        spill_dir=None if spill_dir is None else str(spill_dir),
    )
    params = trainable_parameters(model)
    if not params:
        raise ValueError(
            "the model has no trainable parameters; prepare it with LoRA "
            "(tightfit.prepare(model, lora={...})) or unfreeze some parameters."
        )
    cls = _find_class(_PAGED[opts.kind]) if opts.kind != "adamw" else None
    if cls is None and opts.kind == "paged_adamw":
        # The paged optimizer may be absent from a partial build: train with the reference.
        warnings.warn(
            "tightfit.optim.PagedAdamW is not available; using torch.optim.AdamW (no paging).",
            stacklevel=2,
        )
    if opts.kind == "adamw" or (cls is None and opts.kind == "paged_adamw"):
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
        )
    if cls is None:
        raise ValueError(
            f"optimizer {opts.kind!r} is not available in this build of tightfit; "
            "use kind='paged_adamw' or kind='adamw'."
        )
    paging: dict[str, Any] = {
        "device_budget": device_budget,
        "host_budget": host_budget,
        "spill_dir": opts.spill_dir,
    }
    if page_bytes is not None:
        paging["page_bytes"] = page_bytes
    hyper: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if opts.kind != "paged_sgd":
        hyper["betas"] = betas
    if opts.kind in ("paged_adamw", "paged_adamw8bit"):
        hyper["eps"] = eps
    return cls(params, **hyper, **paging, **extra)
