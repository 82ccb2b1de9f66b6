"""PagedSGD: ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay) on paged state.

The only state is the fp32 ``momentum_buffer`` (none at all without momentum: such groups have
no pages and are updated directly). The math is torch's functional ``sgd`` (fused where the
device supports it, foreach otherwise) on the page views. torch starts a momentum buffer as a
copy of the first gradient; a fresh page holds zeros, for which ``momentum·0 + (1 − dampening)·g``
is that copy exactly when ``dampening == 0``; with dampening the first-step params are passed
to torch as ``None`` buffers, as torch does it, and copied into their pages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.sgd import sgd as _sgd_functional

from tightfit.optim import hyper, sgd_math, update_lists
from tightfit.optim.base import PagedOptimizer
from tightfit.optim.element_order import PLAIN
from tightfit.optim.update_lists import Group, StateLists, Tensors
from tightfit.paging.layout import StateSpec


class PagedSGD(PagedOptimizer):
    """``torch.optim.SGD`` with its momentum buffers in pages.

    Args:
        params: params or param-group dicts.
        lr: learning rate (>= 0).
        momentum: momentum factor (>= 0; 0 keeps no state).
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradient (>= 0).
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        maximize: maximize the objective instead of minimizing it.
        foreach: ``True``: torch's foreach kernels; ``False``: its single-tensor loop;
            ``None``: see ``fused``.
        differentiable: must be ``False`` (paged state is not part of an autograd graph).
        fused: ``True``: torch's fused kernel (honours the AMP scaler's ``grad_scale``);
            ``None`` with ``foreach=None``: fused where the device has it, else foreach;
            ``False``: foreach.
        capturable: must be ``False`` (torch's SGD has no such flag; accepted, as by every
            paged optimizer, so that one set of keywords works for all).
        **paging_kw: the paging and pressure keywords of
            :class:`~tightfit.optim.base.PagedOptimizer`: ``paging=PagingOptions(...)`` or its
            fields (``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``), and
            ``target``, ``probe``.

    ``state_dict()`` is torch's SGD format (``momentum_buffer`` per param, plus ``step``);
    a ``torch.optim.SGD`` state dict loads too.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        capturable: bool = False,
        **paging_kw: Any,
    ) -> None:
        hyper.check_graph_flags({"capturable": capturable}, "torch.optim.SGD")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            # torch's own keys, so a state dict loads into torch.optim.SGD unchanged
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        self._stateless_done: dict[int, int | None] = {}  # group -> step its plain SGD ran in
        super().__init__(params, defaults, **paging_kw)

    def _check_group(self, group: dict[str, Any]) -> None:
        momentum = group["momentum"]
        hyper.check_graph_flags(group, "torch.optim.SGD")
        hyper.check_lr(group["lr"], "0.01")
        hyper.check_nonnegative("momentum", momentum, "0.9")
        hyper.check_nonnegative("weight_decay", group["weight_decay"], "1e-4")
        if group["nesterov"] and (float(momentum) <= 0 or float(group["dampening"]) != 0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening; set momentum "
                "(e.g. 0.9) and dampening=0, or pass nesterov=False"
            )

    def _takes_grad_scale(self, group: dict[str, Any]) -> bool:
        return True  # _sgd unscales: the stateless groups never pass through the base

    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]:
        return [StateSpec("momentum_buffer", torch.float32)] if group["momentum"] != 0 else []

    def _sgd(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        first: list[bool] | None = None,
    ) -> None:
        """torch's SGD on the views, writing nothing when it raises (an out-of-memory error
        is retried by the sweep): torch's fused kernel (it allocates nothing), else
        :mod:`tightfit.optim.sgd_math`'s arrangement of torch's foreach/single-tensor math,
        also for a call that starts buffers (``first``), which the fused kernel can only do
        for every buffer at once."""
        if not params:
            return
        impl = hyper.implementation(group, params[0].device)
        scale = self._grad_scale
        lr = self._host.scalar(group["lr"])  # a tensor lr: read once per step
        hp = {"weight_decay": group["weight_decay"], "momentum": group["momentum"],
              "dampening": group["dampening"], "nesterov": group["nesterov"],
              "maximize": group["maximize"]}  # fmt: skip
        if impl == "fused" and not any(first or ()):
            torch_bufs = list(bufs) if hp["momentum"] != 0 else [None] * len(params)
            _sgd_functional(params, grads, torch_bufs, foreach=False, fused=True, lr=lr,
                            grad_scale=None if scale is None else scale.to(params[0].device),
                            **hp)  # fmt: skip
            return
        if scale is not None:  # unscaled copies (allocated first): grads are never changed
            scale = scale.to(params[0].device)
            grads = [g / scale for g in grads]
        sgd_math.sgd_(params, grads, bufs, first, foreach=impl != "forloop", lr=lr, **hp)

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        first = None
        if group["dampening"] != 0:  # only then does torch's first step differ from a zero buffer
            first = [c == 1 for c in self._host.counts(steps)]
        self._sgd(group, params, grads, states["momentum_buffer"], first)

    def _run_sweep(self) -> None:
        step = self._pending_step
        super()._run_sweep()
        # Groups without momentum have no state and no pages: plain SGD, after the sweep so
        # that a sweep stopped part-way (finish_step) never applies it twice; each group once
        # per step (a retry after an out-of-memory error in a later group skips it), the step
        # pending until every group is done.
        self._pending_step = step
        for gi, group in enumerate(self.param_groups):
            if group["momentum"] == 0 and self._stateless_done.get(gi) != step:
                self._stateless(group)
                self._stateless_done[gi] = step
        self._pending_step = None

    def _stateless(self, group: dict[str, Any]) -> None:
        """Plain SGD on a group's params in their page order (complex as real pairs; memory
        not in that order through staging copies, as the paged update does it)."""
        orders = self._access.orders
        params, flats, grads, staged = [], [], [], {}
        for p in group["params"]:
            if p.grad is None:
                continue
            order = orders.get(id(p), PLAIN)
            flat = order.view(p)
            if flat is None:
                flat = staged[id(p)] = order.flat(p).clone()
            params.append(p)
            flats.append(flat)
            grads.append(order.flat(p.grad))
        self._sgd(group, flats, grads, [])
        update_lists.unstage(params, staged, orders)

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format SGD state dict (``torch.optim.SGD``'s or ours); paging is kept.

        torch's entries have no ``step``: a param with a momentum buffer counts as started, one
        with ``momentum_buffer=None`` as fresh (its next step starts the buffer, as in torch).
        """
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
            state = {}
            for key, entry in state_dict["state"].items():
                if isinstance(entry, dict) and "step" not in entry:
                    if entry.get("momentum_buffer") is None:
                        continue
                    entry = {**entry, "step": torch.tensor(1.0)}
                state[key] = entry
            state_dict = {**state_dict, "state": state}
        super()._load(state_dict)
