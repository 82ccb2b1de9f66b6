"""The tiled autograd function: a per-token function run tile by tile, forward and backward.

:class:`TiledMLPFunction` applies ``run`` to one or more *per-token* inputs (tensors whose
flattened leading dimensions are the same tokens: an MLP's input, or a MoE layer's hidden
states with each token's chosen experts and routing weights) in tiles of tokens. Forward runs
under ``torch.no_grad()`` and keeps only the inputs; backward recomputes each tile with grad
enabled and backpropagates it at once, so only one tile's intermediates are ever alive. The
*trainable* parameters ``run`` uses are inputs of the function: their gradients are returned
summed over the tiles (in fp32 for lower-precision parameters). Inputs that are not floating
point (expert indices) take no grad. :mod:`tightfit.checkpoint.tiling` installs it on MLPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

# -- the autograd function ----------------------------------------------------------------


@dataclass
class _Rng:
    """CPU RNG state and (for a CUDA input) that device's: what dropout in the MLP draws."""

    cpu: torch.Tensor
    device: torch.device | None
    device_state: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> _Rng:
        if device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state(), None, None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device_state, self.device)

    def forked(self) -> contextlib.AbstractContextManager[None]:
        """Put the global RNG back when the block ends: the recompute is invisible to later ops."""
        devices = [self.device] if self.device is not None else []
        return torch.random.fork_rng(devices=devices, device_type="cuda")


def _autocast_states(device: torch.device) -> list[dict[str, Any]]:
    """Autocast settings in effect for ``device`` (and the CPU), to replay in backward."""
    kinds = dict.fromkeys([device.type, "cpu"])
    return [{"device_type": k, "enabled": torch.is_autocast_enabled(k),
             "dtype": torch.get_autocast_dtype(k)} for k in kinds]


@contextlib.contextmanager
def _autocast(states: list[dict[str, Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for s in states:
            stack.enter_context(torch.autocast(**s))
        yield


Inputs = torch.Tensor | Sequence[torch.Tensor]


def _flat(inputs: Inputs) -> tuple[list[torch.Tensor], int]:
    """The inputs as ``[tokens, width]`` rows, and the number of tokens (all must agree)."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    flats = [t.reshape(-1, t.shape[-1]) for t in tensors]
    n = flats[0].shape[0]
    if any(f.shape[0] != n for f in flats):
        raise ValueError(f"the per-token inputs of a tiled function disagree on the number of "
                         f"tokens: {[tuple(t.shape) for t in tensors]}; each must have the "
                         "tokens in its leading dimensions.")
    return flats, n


def run_tiles(run: Callable[..., torch.Tensor], x: Inputs, tile: int) -> torch.Tensor:
    """``run`` applied to ``x`` tile by tile along its flattened leading (token) dimensions.

    ``x`` is one tensor or a sequence of per-token tensors (``run`` gets one tile of each);
    ``run`` must act on each token alone, as an MLP or a MoE layer's experts do. The output
    has the first input's leading dimensions.
    """
    flats, n = _flat(x)
    lead = (x if isinstance(x, torch.Tensor) else x[0]).shape[:-1]
    if n <= tile:  # one tile: its output is the result, no copy
        y = run(*flats)
        return y.view(*lead, y.shape[-1])
    out: torch.Tensor | None = None
    for start in range(0, n, tile):
        y = run(*(f[start:start + tile] for f in flats))
        if out is None:
            out = y.new_empty((n, y.shape[-1]))
        out[start:start + y.shape[0]].copy_(y)
        del y  # free this tile's output before the next tile runs
    assert out is not None
    return out.view(*lead, out.shape[-1])


class TiledMLPFunction(torch.autograd.Function):
    """``run(*inputs)`` in tiles; backward recomputes tile by tile and returns summed param grads.

    ``apply(run, tile, n_inputs, *inputs, *params)``: the first ``n_inputs`` tensors are the
    per-token inputs (the output has the first one's leading dimensions), ``params`` the
    trainable tensors ``run`` uses.
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[..., torch.Tensor], tile: int, n_inputs: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        # Autograd runs this under no_grad: each tile's intermediates die with the tile.
        inputs = tensors[:n_inputs]
        ctx.run, ctx.tile, ctx.n_inputs, ctx.params = run, tile, n_inputs, tensors[n_inputs:]
        ctx.rng = _Rng.capture(inputs[0].device)
        ctx.autocast = _autocast_states(inputs[0].device)
        ctx.save_for_backward(*inputs)  # the only activations kept (a checkpoint may pack them)
        return run_tiles(run, inputs, tile)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors
        n_in = ctx.n_inputs
        want_in = [i for i, need in enumerate(ctx.needs_input_grad[3:3 + n_in]) if need]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3 + n_in:]) if need]
        flats, n = _flat(inputs)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        tile = ctx.tile
        acc: dict[int, torch.Tensor] = {}
        with ctx.rng.forked(), _autocast(ctx.autocast), torch.enable_grad():
            if n <= tile:  # one tile: its input grads are the result, no buffer and no copy
                grads_in, _ = _backward_tile(ctx, flats, g, want_in, wanted, acc, ctx.rng)
            else:
                grads_in = [torch.empty_like(flats[i]) for i in want_in]
                rng = ctx.rng
                for start in range(0, n, tile):
                    part = [f[start:start + tile] for f in flats]
                    gs, rng = _backward_tile(ctx, part, g[start:start + tile], want_in, wanted,
                                             acc, rng)
                    for buf, gi in zip(grads_in, gs):
                        buf[start:start + tile].copy_(gi)
                    del gs  # before the next tile is recomputed
        out_in: list[torch.Tensor | None] = [None] * n_in
        for i, gi in zip(want_in, grads_in):
            out_in[i] = gi.view_as(inputs[i])
        param_grads = [acc[i].to(p.dtype) if i in acc else None for i, p in enumerate(ctx.params)]
        return (None, None, None, *out_in, *param_grads)


def _backward_tile(ctx: Any, xs: list[torch.Tensor], gt: torch.Tensor, want_in: list[int],
                   wanted: list[int], acc: dict[int, torch.Tensor], rng: _Rng,
                   ) -> tuple[list[torch.Tensor], _Rng]:
    """Recompute one tile (input rows ``xs``, output grad ``gt``) and backpropagate it.

    Its parameter grads are added to ``acc``. Returns the grads of the inputs ``want_in``
    names and the RNG state the next tile started from in forward. A function of its own so
    that the tile's graph and grads are freed when it returns.
    """
    rng.restore()  # this tile draws what it drew in forward
    xs = [x.detach().requires_grad_(i in want_in) for i, x in enumerate(xs)]
    yt = ctx.run(*xs)
    after = _Rng.capture(xs[0].device)
    inputs = [xs[i] for i in want_in] + [ctx.params[i] for i in wanted]
    grads = (list(torch.autograd.grad(yt, inputs, gt, allow_unused=True))
             if yt.requires_grad and inputs else [None] * len(inputs))
    del yt  # the tile's graph: free it before the grads are summed
    grads_in = [gi if gi is not None else torch.zeros_like(xs[i])  # output independent of it
                for i, gi in zip(want_in, grads[:len(want_in)])]
    _accumulate(acc, wanted, grads[len(want_in):])
    return grads_in, after


def _accumulate(acc: dict[int, torch.Tensor], wanted: list[int],
                grads: Sequence[torch.Tensor | None]) -> None:
    """Add one tile's parameter grads; below fp32 they are summed in fp32 (as one matmul over
    all tokens would), so tiling does not add a rounding per tile."""
    for i, gi in zip(wanted, grads):
        if gi is None:
            continue
        if i not in acc:
            acc[i] = gi.float() if gi.dtype.itemsize < 4 and gi.is_floating_point() else gi
        else:
            acc[i].add_(gi)


