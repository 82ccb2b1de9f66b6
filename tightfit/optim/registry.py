"""``tightfit.optimizer_for``: the paged optimizer over a prepared model's trainable parameters."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.sgd import PagedSGD

OptimizerKind = Literal[
    "paged_adamw",
    "paged_adam",
    "paged_adamw8bit",
    "paged_adam8bit",
    "paged_lion",
    "paged_lion8bit",
    "paged_sgd",
    "adamw",
]

# kind -> paged class ("adamw" is torch's AdamW, the unpaged reference)
_PAGED: dict[str, type[torch.optim.Optimizer]] = {
    "paged_adamw": PagedAdamW,
    "paged_adam": PagedAdam,
    "paged_adamw8bit": PagedAdamW8bit,
    "paged_adam8bit": PagedAdam8bit,
    "paged_lion": PagedLion,
    "paged_lion8bit": PagedLion8bit,
    "paged_sgd": PagedSGD,
}
# Lion's published default (Chen et al. 2023, also bitsandbytes') differs from Adam's.
_DEFAULT_BETAS = {"paged_lion": (0.9, 0.99), "paged_lion8bit": (0.9, 0.99)}


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


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients (LoRA adapters after :func:`tightfit.prepare`)."""
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_for(
    model: nn.Module,
    kind: OptimizerKind = "paged_adamw",
    *,
    lr: float = 2e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] | None = None,
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
        lr, weight_decay, eps: The usual hyperparameters.
        betas: ``None`` takes the kind's default: (0.9, 0.999) for Adam kinds, (0.9, 0.99)
            for Lion.
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
    if betas is None:
        betas = _DEFAULT_BETAS.get(opts.kind, (0.9, 0.999))
    if opts.kind == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
        )
    cls = _PAGED[opts.kind]
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
    if opts.kind.startswith("paged_adam"):
        hyper["eps"] = eps
    return cls(params, **hyper, **paging, **extra)
