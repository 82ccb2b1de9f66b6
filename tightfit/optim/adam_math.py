"""torch's foreach and single-tensor Adam/AdamW, reordered so that nothing is written before
everything is allocated.

The sweep's rule (:mod:`tightfit.paging.sweep`) is that an update that raises changed
nothing: a page whose update failed is updated again when the step is retried (after an
out-of-memory error, by streaming) or finished (``finish_step()``). torch's fused kernel
keeps that rule (it allocates nothing), but ``torch.optim.adam``'s foreach and single-tensor
paths scale the params by the decay and update both moments in place *before* they allocate
the denominator (``_foreach_sqrt``, ``exp_avg_sq.sqrt()``); an out-of-memory error there left
them half updated and the retry applied the decay and the moment update twice.

Here the same operations, on the same values (torch 2.13's ``_multi_tensor_adam`` and
``_single_tensor_adam`` with ``capturable=False``, ``differentiable=False``) run in another
order: every temporary first, then only in-place writes, which allocate nothing.

* foreach: the new ``exp_avg_sq`` is computed out of place into the denominator's buffer
  (``v * beta2``, then ``+= (1 - beta2) g²``, the same two roundings as torch's in-place pair),
  copied into the state, and the buffer becomes the denominator in place. One extra pass over
  ``exp_avg_sq`` (the copy); the same peak as torch, plus one gradient-sized copy when
  ``maximize`` or L2 decay needs a modified gradient (torch frees that before its sqrt).
* single tensor: one denominator buffer (and, for ``maximize`` or L2 decay, one gradient
  buffer) the size of the largest tensor, allocated before the loop; each tensor's
  temporaries are ``out=`` views of it. The peak is at most torch's (it allocates two
  temporaries per tensor).

On the CPU, torch's foreach ops are themselves a loop over the tensors running the
single-tensor kernels, so ``foreach=True`` runs the loop there: the same results bit for bit
(tested against torch's foreach Adam), without the copy and with one tensor's temporaries.

Step counts are the caller's numbers (the paged optimizers read every count once per step,
:mod:`tightfit.optim.host_reads`), else read with one ``tolist()`` for the call (torch reads
each with ``.item()``: a device sync per tensor); they are the params' counts, already
incremented by the step.
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = list[torch.Tensor]

#: ``foreach=True`` on the CPU runs the loop (see above); tests set it ``False`` to run the
#: foreach arrangement (what CUDA runs) on the CPU.
LOOP_ON_CPU = True


def adam_(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    max_exp_avg_sqs: Tensors,
    steps: Tensors,
    *,
    counts: list[float] | None = None,
    foreach: bool,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: Any,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
) -> None:
    """One Adam/AdamW update of ``params`` and their moments, in place; raises having
    written nothing (what torch's foreach/single-tensor functions compute otherwise).

    Args:
        steps: the step counts of this update (already incremented; only read).
        counts: their values as numbers, when the caller has them (the paged optimizers
            read every count once per step); else read here, once for the call.
        foreach: torch's foreach kernels (``lr`` a number), else its one-tensor loop (which
            on the CPU also stands in for foreach: the same kernels and results there).
    """
    if not params:
        return
    kw = {"amsgrad": amsgrad, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
          "eps": eps, "maximize": maximize, "decoupled": decoupled_weight_decay}  # fmt: skip
    counts = _counts(steps) if counts is None else counts
    if foreach and not (LOOP_ON_CPU and params[0].device.type == "cpu"):
        _foreach(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, counts, lr=lr, **kw)
    else:
        _loop(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, counts, lr=lr, **kw)


def _counts(steps: Tensors) -> list[float]:
    """The step counts as numbers: one read for the call, not one per tensor."""
    if len({s.device for s in steps}) == 1:
        return torch.stack(steps).tolist()
    return [float(s.item()) for s in steps]


def _foreach(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    max_exp_avg_sqs: Tensors,
    counts: list[float],
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
) -> None:
    # Allocations (nothing written yet).
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0 and not decoupled:
        if maximize:  # our own copy already
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    denom = torch._foreach_mul(exp_avg_sqs, beta2)  # the new exp_avg_sq, then the denominator
    torch._foreach_addcmul_(denom, grads, grads, 1 - beta2)
    step_size = [(lr / (1 - beta1**c)) * -1 for c in counts]
    bias_correction2_sqrt = [(1 - beta2**c) ** 0.5 for c in counts]
    # In-place writes only from here.
    if weight_decay != 0 and decoupled:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_copy_(exp_avg_sqs, denom)
    if amsgrad:
        torch._foreach_maximum_(denom, max_exp_avg_sqs)
        torch._foreach_copy_(max_exp_avg_sqs, denom)
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _loop(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    max_exp_avg_sqs: Tensors,
    counts: list[float],
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: Any,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
) -> None:
    if isinstance(lr, torch.Tensor) and lr.dim() != 0:  # as torch's _to_scalar
        lr = lr.squeeze()
    largest = max(v.numel() for v in exp_avg_sqs)
    # Allocations (nothing written yet): every tensor's temporaries are views of these.
    den_buf = exp_avg_sqs[0].new_empty(largest)
    l2 = weight_decay != 0 and not decoupled
    grad_buf = grads[0].new_empty(largest) if maximize or l2 else None
    # In-place writes only from here.
    for i, param in enumerate(params):
        grad, exp_avg, exp_avg_sq = grads[i], exp_avgs[i], exp_avg_sqs[i]
        if grad_buf is not None:
            g = grad_buf[: grad.numel()].view_as(grad)
            if maximize:
                grad = torch.neg(grad, out=g)
            if l2:
                grad = torch.add(grad, param, alpha=weight_decay, out=g)
        if weight_decay != 0 and decoupled:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = counts[i]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = den_buf[: exp_avg_sq.numel()].view_as(exp_avg_sq)
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            torch.sqrt(max_exp_avg_sqs[i], out=denom)
        else:
            torch.sqrt(exp_avg_sq, out=denom)
        denom.div_(bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
