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
from tightfit.pressure.occupancy import default_probe
from tightfit.pressure.probes import Probe
from tightfit.pressure.target import default_target

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
# What --target takes: "auto" (on where it can act), a fraction of capacity, bytes, or None.
Target = float | int | Literal["auto"] | None

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
    target: Target = field(
        default="auto",
        metadata={"help": "keep the device's total usage under this, evicting optimizer pages "
                          "before activation spikes pass it: a fraction of capacity (0.9) or "
                          "bytes (6GiB; on the CPU it reads RSS); auto: 0.9 of a CUDA device, "
                          "or of the memory cgroup's limit on the CPU (off without one); none: "
                          "off (see docs/pressure.md)"},
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
        check_target(self.target)


def check_target(target: object) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``target`` is a value ``--target`` takes."""
    if target is None or target == "auto":
        return
    if isinstance(target, bool) or not isinstance(target, int | float):
        raise TypeError(f"target must be 'auto', a fraction (0.9), bytes (6GiB) or none, got "
                        f"{target!r}.")
    if isinstance(target, float) and not 0.0 < target <= 1.0:
        raise ValueError(f"a fractional target must be in (0, 1], got {target}; pass bytes as "
                         "an integer (e.g. 6GiB) or a fraction such as 0.9.")
    if isinstance(target, int) and target <= 0:
        raise ValueError(f"a target in bytes must be positive, got {target}; e.g. 6GiB.")


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
    target: Target = "auto",
    probe: Probe | None = None,
    watch: bool = True,
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
        target: The device usage to stay under (``docs/pressure.md``): ``"auto"`` (default)
            is :func:`~tightfit.pressure.target.default_target` — 0.9 of a CUDA device, 0.9 of
            the memory cgroup's limit on the CPU, and off on a CPU without a limit; a float is
            a fraction of capacity, an int bytes; ``None`` turns pressure handling off.
            ``"adamw"`` has no pages to move: it takes only ``"auto"`` or ``None``.
        probe: Reads the device's usage (default_probe: CUDA's allocator, the CPU's cgroup/RSS).
        watch: With a target, hook ``model``'s blocks (:meth:`PagedOptimizer.watch`) so pages
            leave before a spike passes it; the hooks fire under any loop that calls the
            model, Hugging Face's ``Trainer`` included.
        **extra: Passed on to the optimizer class.

    Raises:
        ValueError: No trainable parameters, an unknown kind, bad budgets.
    """
    opts = OptimizerOptions(
        kind=kind, lr=lr, weight_decay=weight_decay, page_bytes=page_bytes,
        device_budget=device_budget, host_budget=host_budget,
        spill_dir=None if spill_dir is None else str(spill_dir), target=target,
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
        if target not in ("auto", None) or probe is not None:
            raise ValueError(
                f"target={target!r} needs a paged optimizer (torch's AdamW has no pages to move "
                "off the device); choose kind='paged_adamw' or pass target='auto' or None."
            )
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra
        )
    cls = _PAGED[opts.kind]
    paging: dict[str, Any] = {
        "device_budget": device_budget, "host_budget": host_budget, "spill_dir": opts.spill_dir,
    }
    if page_bytes is not None:
        paging["page_bytes"] = page_bytes
    hyper: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if opts.kind != "paged_sgd":
        hyper["betas"] = betas
    if opts.kind.startswith("paged_adam"):
        hyper["eps"] = eps
    paging["target"], paging["probe"] = _pressure(target, probe, params[0].device)
    opt = cls(params, **hyper, **paging, **extra)
    if watch and paging["target"] is not None:
        opt.watch(model)
    return opt


def _pressure(
    target: Target, probe: Probe | None, device: torch.device
) -> tuple[float | int | None, Probe | None]:
    """``(target, probe)`` for the optimizer: ``"auto"`` resolved for ``device``."""
    if target != "auto":
        return target, probe if target is not None else None
    if device.type not in ("cuda", "cpu"):
        return None, None  # meta params (no memory yet), or a device without a built-in probe
    probe = probe if probe is not None else default_probe(device)
    auto = default_target(probe)
    return auto, probe if auto is not None else None
