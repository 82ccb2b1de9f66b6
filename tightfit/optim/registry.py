"""``tightfit.optimizer_for``: the paged optimizer over a prepared model's trainable parameters."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from tightfit.optim.adamw import PagedAdam, PagedAdamW
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit
from tightfit.optim.base import PagedOptimizer
from tightfit.optim.lion import PagedLion, PagedLion8bit
from tightfit.optim.optimizer_options import OptimizerOptions, Target
from tightfit.optim.sgd import PagedSGD
from tightfit.pressure.occupancy import default_probe
from tightfit.pressure.probes import Probe
from tightfit.pressure.target import default_target

# kind -> paged class ("adamw" is torch's AdamW, the unpaged reference)
CLASSES: dict[str, type[PagedOptimizer]] = {
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
_FIELDS = frozenset(f.name for f in fields(OptimizerOptions) if f.init)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients (LoRA adapters after :func:`tightfit.prepare`)."""
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_for(
    model: nn.Module, options: OptimizerOptions | None = None, **overrides: Any
) -> torch.optim.Optimizer:
    """Build the optimizer over ``model``'s trainable parameters.

    Args:
        model: A prepared model (only parameters with ``requires_grad`` are optimized).
        options: Every choice (:class:`~tightfit.optim.optimizer_options.OptimizerOptions`:
            the kind, hyperparameters, paging budgets, pressure target, probe and watch);
            ``None``: its defaults (``paged_adamw`` at the QLoRA recipe's lr 2e-4). The
            target (``docs/pressure.md``): ``"auto"`` (default) is
            :func:`~tightfit.pressure.target.default_target` — 0.9 of a CUDA device, 0.9 of
            the memory cgroup's limit on the CPU, and off on a CPU without a limit; a float
            is a fraction of capacity, an int bytes; ``None`` turns pressure handling off.
            ``"adamw"`` (torch's AdamW, no paging: the reference) ignores the paging options
            and takes only ``"auto"`` or ``None``. With ``watch`` and a target, ``model``'s
            blocks are hooked (:meth:`PagedOptimizer.watch`) so pages leave before a spike
            passes it; the hooks fire under any loop that calls the model, Hugging Face's
            ``Trainer`` included.
        **overrides: Fields of the options (``kind="paged_sgd"``, ``lr=1e-4``,
            ``device_budget=...``) and further keywords of the optimizer class
            (``momentum=0.9``: they join ``options.extra``). With ``options`` given, a field
            given again must have the same value: a different one is a ``ValueError`` naming
            both (change the options instead: ``dataclasses.replace(options, lr=...)``).

    Raises:
        ValueError: No trainable parameters, an unknown kind, bad budgets, an override that
            contradicts ``options``.
    """
    opts = _with_overrides(options, overrides)
    params = trainable_parameters(model)
    if not params:
        raise ValueError(
            "the model has no trainable parameters; prepare it with LoRA "
            "(tightfit.prepare(model, lora={...})) or unfreeze some parameters."
        )
    betas = opts.betas if opts.betas is not None else _DEFAULT_BETAS.get(opts.kind, (0.9, 0.999))
    if opts.kind == "adamw":
        if opts.target not in ("auto", None) or opts.probe is not None:
            raise ValueError(
                f"target={opts.target!r} needs a paged optimizer (torch's AdamW has no pages to "
                "move off the device); choose kind='paged_adamw' or pass target='auto' or None."
            )
        return torch.optim.AdamW(params, lr=opts.lr, betas=betas, eps=opts.eps,
                                 weight_decay=opts.weight_decay, **opts.extra)  # fmt: skip
    hyper: dict[str, Any] = {"lr": opts.lr, "weight_decay": opts.weight_decay}
    if opts.kind != "paged_sgd":
        hyper["betas"] = betas
    if opts.kind.startswith("paged_adam"):
        hyper["eps"] = opts.eps
    target, probe = _pressure(opts.target, opts.probe, params[0].device)
    opt = CLASSES[opts.kind](
        params, **hyper, paging=opts.paging, target=target, probe=probe, **opts.extra
    )
    if opts.watch and target is not None:
        opt.watch(model)
    return opt


def _with_overrides(options: OptimizerOptions | None, overrides: dict[str, Any]) -> OptimizerOptions:
    """``options`` (or the defaults) with the keywords of :func:`optimizer_for` applied."""
    given = {k: v for k, v in overrides.items() if k in _FIELDS}
    extra = {k: v for k, v in overrides.items() if k not in _FIELDS}
    if options is None:
        return OptimizerOptions(**{**given, "extra": {**given.get("extra", {}), **extra}})
    if not isinstance(options, OptimizerOptions):
        hint = f"; pass the kind as kind={options!r}" if isinstance(options, str) else ""
        raise TypeError(f"options must be an OptimizerOptions or None, got {options!r}{hint}")
    conflicts = [(f"options.{k}", getattr(options, k), k, v)
                 for k, v in given.items() if getattr(options, k) != v]
    conflicts += [(f"options.extra[{k!r}]", options.extra[k], k, v)
                  for k, v in extra.items() if k in options.extra and options.extra[k] != v]
    if conflicts:
        shown = "; ".join(f"{a}={b!r} and {c}={d!r}" for a, b, c, d in conflicts)
        raise ValueError(f"optimizer_for got {shown}: pass each choice once, in the options "
                         "(dataclasses.replace(options, ...)) or as a keyword without them")
    return replace(options, extra={**options.extra, **extra}) if extra else options


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
