"""torch's foreach and single-tensor SGD, arranged so that nothing is written before everything
is allocated (the sweep's rule, as :mod:`tightfit.optim.adam_math` keeps it for Adam).

torch 2.13's ``_single_tensor_sgd`` allocates per tensor (``-grad``, ``grad.add(param)`` for
weight decay, ``grad.add(buf)`` for Nesterov) after it has updated the tensors before it, and
``_multi_tensor_sgd`` with Nesterov adds the buffers into the gradients in place (``p.grad``
itself when there is no weight decay or maximize), after updating the buffers. An out-of-memory
error there left the update half applied (or the gradients changed), and the step's retry
applied it again. Here the same operations, on the same values:

* foreach: the gradient copies (maximize, weight decay, and for Nesterov a copy when the
  gradient is the caller's) are made first; then the buffers, the Nesterov direction and the
  params are updated in place, which allocates nothing;
* single tensor: one buffer the size of the largest tensor, allocated before the loop, holds
  each tensor's modified gradient (``out=`` views of it).

A momentum buffer marked ``first`` is started as torch starts a ``None`` buffer: a copy of the
(modified) gradient, written into the page.
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = list[torch.Tensor]


def sgd_(
    params: Tensors,
    grads: Tensors,
    bufs: Tensors,
    first: list[bool] | None = None,
    *,
    foreach: bool,
    weight_decay: float,
    momentum: float,
    lr: Any,
    dampening: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """One SGD update of ``params`` (and their momentum buffers, when ``momentum != 0``) in
    place; raises having written nothing (torch's foreach/single-tensor SGD otherwise).

    Args:
        bufs: the momentum buffers (ignored, may be empty, when ``momentum == 0``).
        first: per tensor, whether its buffer starts this step (a copy of the gradient, as
            torch starts a ``None`` buffer); ``None``: none does.
        foreach: torch's foreach arrangement, else its one-tensor loop.
    """
    if not params:
        return
    if isinstance(lr, torch.Tensor):  # as torch's _to_scalar
        lr = lr.item()
    kw = {"weight_decay": weight_decay, "momentum": momentum, "lr": lr,
          "dampening": dampening, "nesterov": nesterov, "maximize": maximize}  # fmt: skip
    first = first or [False] * len(params)
    (_foreach if foreach else _loop)(params, grads, bufs, first, **kw)


def _foreach(params: Tensors, grads: Tensors, bufs: Tensors, first: list[bool], *,
             weight_decay: float, momentum: float, lr: float, dampening: float,
             nesterov: bool, maximize: bool) -> None:  # fmt: skip
    # Allocations (nothing written yet).
    own = False  # whether `grads` are our copies (in-place writes to them are ours)
    if maximize:
        grads, own = torch._foreach_neg(grads), True
    if weight_decay != 0:
        if own:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads, own = torch._foreach_add(grads, params, alpha=weight_decay), True
    if momentum != 0 and nesterov and not own:
        grads = [g.clone() for g in grads]  # torch adds the buffers into p.grad itself
    # In-place writes only from here.
    if momentum != 0:
        rest = [k for k, f in enumerate(first) if not f]
        started = [k for k, f in enumerate(first) if f]
        if rest:
            torch._foreach_mul_([bufs[k] for k in rest], momentum)
            torch._foreach_add_([bufs[k] for k in rest], [grads[k] for k in rest],
                                alpha=1 - dampening)  # fmt: skip
        if started:
            torch._foreach_copy_([bufs[k] for k in started], [grads[k] for k in started])
        if nesterov:
            torch._foreach_add_(grads, bufs, alpha=momentum)
        else:
            grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)


def _loop(params: Tensors, grads: Tensors, bufs: Tensors, first: list[bool], *,
          weight_decay: float, momentum: float, lr: float, dampening: float,
          nesterov: bool, maximize: bool) -> None:  # fmt: skip
    # Allocations (nothing written yet): each tensor's modified gradient is a view of this.
    modified = maximize or weight_decay != 0 or (momentum != 0 and nesterov)
    largest = max(g.numel() for g in grads)
    scratch = grads[0].new_empty(largest) if modified else None
    # In-place writes only from here.
    for i, param in enumerate(params):
        grad = grads[i]
        g = scratch[: grad.numel()].view_as(grad) if scratch is not None else grad
        if maximize:
            grad = torch.neg(grad, out=g)
        if weight_decay != 0:
            grad = torch.add(grad, param, alpha=weight_decay, out=g)
        if momentum != 0:
            buf = bufs[i]
            if first[i]:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            if nesterov:
                grad = torch.add(grad, buf, alpha=momentum, out=g)
            else:
                grad = buf
        param.add_(grad, alpha=-lr)
