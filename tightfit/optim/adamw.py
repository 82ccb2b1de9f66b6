"""PagedAdamW and PagedAdam: torch's Adam/AdamW math on paged state.

Only the layout (``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``; fp32) and
the call into torch's kernels live here; paging is the base class's. The kernels are torch's
fused ``_fused_adamw_``/``_fused_adam_`` where the device supports them (they only read the
step counts, which the base class increments once per param), else torch's foreach or
single-tensor Adam math (``foreach=False``: the flags select as in
:func:`tightfit.optim.hyper.implementation`) as :mod:`tightfit.optim.adam_math` runs it:
every temporary allocated before anything is written, so an update that runs out of memory
changed nothing and the step's retry applies it once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tightfit.optim import adam_math, hyper
from tightfit.optim.base import PagedOptimizer
from tightfit.optim.update_lists import Group, StateLists, Tensors
from tightfit.paging.layout import StateSpec


def check_adam_group(group: dict[str, Any]) -> None:
    """The hyperparameter rules of torch's AdamW/Adam (8-bit Adam's too: same rules, same words)."""
    hyper.check_graph_flags(group, "torch.optim.AdamW")
    hyper.check_lr(group["lr"], group=group)
    hyper.check_betas(group["betas"], group=group)
    hyper.check_eps(group["eps"])
    hyper.check_nonnegative("weight_decay", group["weight_decay"], "0.01")


class PagedAdamW(PagedOptimizer):
    """``torch.optim.AdamW`` with its state in pages that can live on device, host or disk.

    Args:
        params: params or param-group dicts.
        lr: learning rate (float or 0-dim tensor, >= 0).
        betas: coefficients of the running averages, each in [0, 1).
        eps: term added to the denominator (> 0).
        weight_decay: decoupled weight decay (>= 0).
        amsgrad: keep the running maximum of ``exp_avg_sq``.
        maximize: maximize the objective instead of minimizing it.
        foreach: ``True``: torch's foreach kernels; ``False``: torch's single-tensor loop;
            ``None``: see ``fused``.
        capturable: must be ``False`` (CUDA-graph capture cannot page); kept for torch's
            signature and state dicts.
        differentiable: must be ``False`` (paged state is not part of an autograd graph).
        fused: ``True``: torch's fused kernel (honours the AMP scaler's ``grad_scale`` and
            ``found_inf``); ``None`` with ``foreach=None``: fused where the device has it,
            else foreach; ``False``: foreach.
        **paging_kw: the paging and pressure keywords of
            :class:`~tightfit.optim.base.PagedOptimizer`: ``paging=PagingOptions(...)`` or its
            fields (``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``), and
            ``target``, ``probe``.

    Example:
        >>> opt = PagedAdamW(model.parameters(), lr=1e-4, device_budget=256 << 20)
        >>> loss.backward(); opt.step(); opt.zero_grad()
        >>> opt.memory_stats()["bytes_paged_in"]
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **paging_kw: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            # torch's own keys, so a state dict loads into torch.optim.AdamW/Adam unchanged
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": self._decoupled,
        }
        super().__init__(params, defaults, **paging_kw)
        if fused:  # as torch: the AMP scaler leaves unscaling and the inf check to step()
            self._step_supports_amp_scaling = True

    def _load(self, state_dict: dict[str, Any]) -> None:
        super()._load(state_dict)
        if self._decoupled:  # as torch.optim.AdamW.__setstate__: AdamW always decouples
            for group in self.param_groups:
                group["decoupled_weight_decay"] = True

    def _check_group(self, group: dict[str, Any]) -> None:
        check_adam_group(group)

    def _takes_grad_scale(self, group: dict[str, Any]) -> bool:
        return hyper.implementation(group, self.pager.device) == "fused"

    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]:
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        return [StateSpec(n, torch.float32) for n in names]

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        # AdamW always decouples (as torch.optim.AdamW); Adam follows its group, as torch.optim.Adam
        decoupled = self._decoupled or bool(group.get("decoupled_weight_decay", False))
        impl = hyper.implementation(group, params[0].device)
        beta1, beta2 = hyper.scalar(group["betas"][0]), hyper.scalar(group["betas"][1])
        lr = group["lr"]
        if impl == "fused":
            # torch's fused kernel itself: it only reads the step counts (torch's wrapper adds
            # 1 first, which we did once per param at the start of the step).
            kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
            # as torch's _fused_adamw: a CPU lr tensor goes in as it is (the kernel reads it as
            # a number; copying it to the GPU would block on every call); another device's moves
            on_other = isinstance(lr, torch.Tensor) and lr.device != params[0].device
            if on_other and lr.device.type != "cpu":
                lr = lr.to(params[0].device)
            scale = self._grad_scale
            kernel(
                params,
                grads,
                states["exp_avg"],
                states["exp_avg_sq"],
                states.get("max_exp_avg_sq", []),
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=group["amsgrad"],
                maximize=group["maximize"],
                grad_scale=None if scale is None else scale.to(params[0].device),
            )
            return
        # step counts and a tensor lr as host values, read once per step (not per update
        # call: that is a device sync per streamed page); foreach kernels take lr as a number
        lr = self._host.scalar(lr) if impl == "foreach" else self._host.on_host(lr)
        # torch's foreach/single-tensor math, allocating before it writes (adam_math): an
        # update that raises (out of memory) changed nothing, as the sweep needs
        adam_math.adam_(
            params,
            grads,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq", []),
            steps,
            counts=self._host.counts(steps),
            foreach=impl == "foreach",
            decoupled_weight_decay=decoupled,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class PagedAdam(PagedAdamW):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient) with paged state.

    Same arguments as :class:`PagedAdamW`; ``weight_decay`` defaults to 0 as in torch.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
