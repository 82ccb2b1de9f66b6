"""PagedLion (fp32 state) and PagedLion8bit (blockwise 8-bit state): Lion on paged state.

Lion (Chen et al. 2023) keeps one momentum per parameter and steps by its sign:
``p ← p·(1 − lr·wd) − lr·sign(β1·m + (1 − β1)·g)``, then ``m ← β2·m + (1 − β2)·g``. The
arithmetic follows bitsandbytes' Lion (the same operations in the same order) with torch's
foreach kernels over all segments of a sweep batch; the 8-bit variant runs bitsandbytes'
``optimizer_update_8bit_blockwise("lion", ...)`` on the page views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tightfit.optim import hyper, quant8
from tightfit.optim.base import PagedOptimizer
from tightfit.optim.paged8bit import Paged8bitOptimizer
from tightfit.optim.update_lists import Group, StateLists, Tensors
from tightfit.paging.layout import StateSpec


def lion_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    foreach: bool = True,
) -> None:
    """One Lion step on parallel lists of fp32 tensors, in place (foreach kernels; with
    ``foreach=False`` the same operations one tensor at a time).

    Every temporary is allocated before anything is written (the update direction: for all
    tensors with foreach, one buffer the size of the largest tensor for the loop), so an
    update that raises (out of memory) changed nothing and the sweep's retry applies it once.
    """
    if not params:
        return
    if not foreach:
        scratch = exp_avgs[0].new_empty(max(m.numel() for m in exp_avgs))
        for p, g, m in zip(params, grads, exp_avgs):
            update = scratch[: m.numel()].view_as(m)
            torch.mul(m, beta1, out=update)
            _lion_apply([p], [g], [m], [update], lr, beta1, beta2, weight_decay)
        return
    update = torch._foreach_mul(exp_avgs, beta1)  # the only allocation
    _lion_apply(params, grads, exp_avgs, update, lr, beta1, beta2, weight_decay)


def _lion_apply(params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], update: list[torch.Tensor], lr: float,
                beta1: float, beta2: float, weight_decay: float) -> None:  # fmt: skip
    """Lion's in-place part, given ``update = β1·m`` (allocates nothing). The params' decay
    reads nothing the direction needs, so it comes after the direction's allocation with the
    same result."""
    torch._foreach_add_(update, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(update)
    if weight_decay > 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)


def _check_lion(group: dict[str, Any]) -> None:
    hyper.check_graph_flags(group, "PagedLion", fused_kernel=False)
    hyper.check_lr(group["lr"])
    hyper.check_betas(group["betas"], "(0.9, 0.99)", keyword=False)
    hyper.check_nonnegative("weight_decay", group["weight_decay"], "0.01")


def _lion_group(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    scalar: Callable[[Any], float],
) -> None:
    """``scalar``: the optimizer's once-per-step reader (``HostReads.scalar``): a tensor lr
    read per update call would be a device sync per bucket (per streamed page)."""
    beta1, beta2 = group["betas"]
    lion_update_(
        params,
        grads,
        exp_avgs,
        lr=scalar(group["lr"]),
        beta1=scalar(beta1),
        beta2=scalar(beta2),
        weight_decay=float(group["weight_decay"]),
        foreach=group.get("foreach") is not False,
    )


def _flags(
    foreach: bool | None, fused: bool | None, capturable: bool, differentiable: bool
) -> dict[str, Any]:
    """torch's flags as group keys: ``foreach=False`` runs the update one tensor at a time;
    ``fused=True`` (no fused Lion kernel), ``capturable``, ``differentiable`` raise."""
    return {"foreach": foreach, "fused": fused, "capturable": capturable,
            "differentiable": differentiable}  # fmt: skip


class PagedLion(PagedOptimizer):
    """Lion with fp32 momentum (``exp_avg``) kept in pages.

    Args:
        params: params or param-group dicts.
        lr: learning rate (>= 0); Lion wants 3-10x less than AdamW.
        betas: (β1 for the update direction, β2 for the momentum), each in [0, 1).
        weight_decay: decoupled weight decay (>= 0).
        foreach: ``None``/``True``: torch's foreach kernels; ``False``: one tensor at a time.
        fused, capturable, differentiable: torch's flags; ``True`` raises (there is no fused
            Lion kernel; paged state is neither capturable nor differentiable).
        **paging_kw: the paging and pressure keywords of
            :class:`~tightfit.optim.base.PagedOptimizer`: ``paging=PagingOptions(...)`` or its
            fields (``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``), and
            ``target``, ``probe``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **paging_kw: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay,
                    **_flags(foreach, fused, capturable, differentiable)}  # fmt: skip
        super().__init__(params, defaults, **paging_kw)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_lion(group)

    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]:
        return [StateSpec("exp_avg", torch.float32)]

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        _lion_group(group, params, grads, states["exp_avg"], self._host.scalar)


class PagedLion8bit(Paged8bitOptimizer):
    """Lion with blockwise 8-bit momentum (bitsandbytes' ``Lion8bit``) kept in pages.

    Same arguments (and torch flags) as :class:`PagedLion` plus ``min_8bit_size`` and
    ``backend`` (see
    :class:`~tightfit.optim.adamw8bit.PagedAdamW8bit`), then the paging and pressure keywords
    (``paging=PagingOptions(...)`` or its fields, ``target``, ``probe``: see
    :class:`~tightfit.optim.base.PagedOptimizer`). About 1.02 bytes of state per param.
    """

    kernel = "lion"
    torch_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        min_8bit_size: int = quant8.MIN_8BIT_SIZE,
        backend: quant8.Backend = "auto",
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **paging_kw: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay,
                    **_flags(foreach, fused, capturable, differentiable)}  # fmt: skip
        super().__init__(params, defaults, min_8bit_size=min_8bit_size, backend=backend, **paging_kw)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_lion(group)

    def _kernel_args(self, group: dict[str, Any]) -> tuple[float, float, float, float]:
        beta1, beta2 = group["betas"]
        return hyper.scalar(beta1), hyper.scalar(beta2), 0.0, float(group["weight_decay"])

    def _update_fp32(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        _lion_group(group, params, grads, states["state1"], self._host.scalar)
