"""PagedAdamW8bit and PagedAdam8bit: bitsandbytes' blockwise 8-bit Adam on paged state.

The state is bitsandbytes' (signed dynamic map for ``exp_avg``, unsigned for ``exp_avg_sq``,
256-element blocks, fp32 below 4,096 elements) and so is the update: bitsandbytes'
``optimizer_update_8bit_blockwise("adam", ...)`` runs on each page's views. fp32 segments
(small params, and the ``backend="torch"`` path after dequantizing) use torch's functional
Adam, fused where the device supports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as _adam_functional

from tightfit.optim import adam_math, hyper, quant8
from tightfit.optim.adamw import check_adam_group
from tightfit.optim.paged8bit import Paged8bitOptimizer
from tightfit.optim.update_lists import Group, StateLists, Tensors


class PagedAdamW8bit(Paged8bitOptimizer):
    """AdamW with blockwise 8-bit state (bitsandbytes' ``AdamW8bit``) kept in pages.

    About 2.03 bytes of state per parameter (two uint8 codes plus two fp32 absmax per 256
    elements), all of it paged: codes and their absmax move together.

    Args:
        params: params or param-group dicts.
        lr: learning rate (>= 0).
        betas: coefficients of the running averages, each in [0, 1).
        eps: term added to the denominator (> 0).
        weight_decay: decoupled weight decay (>= 0).
        min_8bit_size: params with fewer elements keep fp32 state (bitsandbytes: 4096).
        backend: ``"auto"``: bitsandbytes' kernel where it has one (CUDA, XPU, CPU), plain
            torch elsewhere; ``"bitsandbytes"``; ``"torch"``.
        foreach, fused: torch's flags; they choose torch's kernels for the fp32 math (params
            under ``min_8bit_size``, and the ``backend="torch"`` path), as in
            :class:`~tightfit.optim.adamw.PagedAdamW`.
        capturable, differentiable: must be ``False`` (torch's flags; paged state is neither).
        **paging_kw: the paging and pressure keywords of
            :class:`~tightfit.optim.base.PagedOptimizer`: ``paging=PagingOptions(...)`` or its
            fields (``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``), and
            ``target``, ``probe``.

    Example:
        >>> opt = PagedAdamW8bit(model.parameters(), lr=1e-4, device_budget=64 << 20)
        >>> loss.backward(); opt.step(); opt.zero_grad()
        >>> opt.memory_stats()["state_bytes"] / n_params   # ~2.03
    """

    kernel = "adam"
    torch_names = ("exp_avg", "exp_avg_sq")
    _decoupled = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        min_8bit_size: int = quant8.MIN_8BIT_SIZE,
        backend: quant8.Backend = "auto",
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **paging_kw: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "foreach": foreach, "fused": fused, "capturable": capturable,
                    "differentiable": differentiable}  # fmt: skip
        super().__init__(params, defaults, min_8bit_size=min_8bit_size, backend=backend, **paging_kw)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_adam_group(group)

    def _kernel_args(self, group: dict[str, Any]) -> tuple[float, float, float, float]:
        beta1, beta2 = (hyper.scalar(b) for b in group["betas"])
        wd = float(group["weight_decay"]) if self._decoupled else 0.0
        return beta1, beta2, float(group["eps"]), wd

    def _kernel_grad(
        self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor:
        wd = float(group["weight_decay"])
        if self._decoupled or wd == 0.0:
            return grad
        # Adam's L2 decay goes into the gradient (bitsandbytes' kernel only decays decoupled)
        return torch.add(grad, param, alpha=wd)

    def _update_fp32(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        impl = hyper.implementation(group, params[0].device)
        beta1, beta2 = (hyper.scalar(b) for b in group["betas"])
        lr = group["lr"]
        if impl != "fused":  # allocating before it writes: a failed update changed nothing
            # step counts and a tensor lr read once per step, not per update call
            lr = self._host.scalar(lr) if impl == "foreach" else self._host.on_host(lr)
            adam_math.adam_(
                params, grads, states["state1"], states["state2"], [], steps,
                counts=self._host.counts(steps),
                foreach=impl == "foreach", decoupled_weight_decay=self._decoupled,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip
            return
        _adam_functional(
            params,
            grads,
            states["state1"],
            states["state2"],
            [],
            torch._foreach_sub(steps, 1),  # the kernel adds 1 to these copies, not to ours
            fused=True,
            decoupled_weight_decay=self._decoupled,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


class PagedAdam8bit(PagedAdamW8bit):
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``) with paged
    blockwise 8-bit state. Same arguments as :class:`PagedAdamW8bit`; ``weight_decay``
    defaults to 0. (bitsandbytes' own ``Adam8bit`` decays decoupled; this follows torch.)
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
