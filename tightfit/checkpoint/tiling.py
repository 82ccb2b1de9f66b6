"""Tiled MLPs: each decoder layer's MLP runs in tiles of tokens, forward and backward.

At long sequence length a Llama-family MLP's gate/up/activation intermediates (``tokens ×
intermediate`` each, plus their LoRA and dropout companions) are the widest tensors of the
layer. :func:`enable_tiling` patches the ``mlp`` child of every block (found by
:func:`~tightfit.model.blocks.find_blocks`) so that:

* **forward** runs the MLP tile by tile along the *flattened* ``batch · seq`` tokens under
  ``torch.no_grad()`` and keeps only the MLP's input (the MLP acts on each token alone, so
  tiling along the flattened tokens is exact and makes a tile ``tile_tokens`` tokens whatever
  the batch shape; the last tile is shorter);
* **backward** recomputes each tile with grad enabled and backpropagates it at once, so only
  one tile's intermediates are ever alive. The MLP's *trainable* parameters (LoRA factors, or
  the projections when they are trained) are inputs of the autograd function: their gradients
  are returned summed over the tiles (accumulated in fp32 for lower-precision parameters),
  never written into ``.grad`` from inside backward. Frozen (e.g. NF4) weights take no grad.

The RNG state is captured before the first tile and restored for the recompute (CPU and the
input's CUDA device, as ``torch.utils.checkpoint`` does), so LoRA dropout draws the same masks
in the recompute as in forward; the global RNG is untouched by backward. Autocast state is
replayed too. Masks are drawn per tile, so with dropout a tiled run is an equally distributed
but different sample than an untiled one (identical when one tile covers the batch).

Inside a checkpointed segment (:func:`tightfit.checkpoint.enable`) the recompute of the layer
runs the tiled forward again: its transient is the tile's, and the saved input is restored by
the checkpoint like any other saved tensor. The MLP then runs three times per step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from tightfit.model.blocks import resolve_blocks

STATE_ATTR = "_tightfit_tiling"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MISSING = object()
_TILED_MARK = "__tightfit_tiled__"

TileTokens = int | Literal["auto"]


@dataclass(frozen=True)
class Tiling:
    """What :func:`enable_tiling` installed.

    Attributes:
        tile_tokens: Tokens per tile, or ``"auto"`` (:func:`auto_tile_tokens`, per call).
        modules: The attribute name of the tiled child in each block (``"mlp"``).
        layers: How many MLPs are tiled.
        notes: Things about the model that tiling does not bound (e.g. T×T attention).
    """

    tile_tokens: TileTokens
    modules: str
    layers: int
    notes: tuple[str, ...] = ()


@dataclass
class _Installed:
    info: Tiling
    mlps: list[nn.Module]
    saved_forwards: list[Any]


MIN_AUTO_TILE_TOKENS = 64


def auto_tile_tokens(hidden_size: int, intermediate_size: int, tokens: int) -> int:
    """The ``"auto"`` tile for a batch of ``tokens``: the smallest of ``hidden_size`` and
    ``ceil(tokens · hidden_size / intermediate_size)``, at least 64 tokens, at most all.

    The rule bounds one tile's ``tile × intermediate`` tensors twice: by one hidden state of
    the batch (``tokens × hidden``), so the MLP never outweighs the attention and the rest of
    the layer, which hold several of those (its bytes then grow with the sequence only as
    fast as theirs); and by one MLP weight matrix (``hidden × intermediate``), so at long
    context they stop growing at all (DeepSpeed/Arctic's TiledMLP uses ``hidden`` tokens). A
    64-token floor keeps each tile's matmuls efficient.
    """
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if v < 1:
            raise ValueError(f"{name} must be ≥ 1, got {v}.")
    if tokens < 1:
        return 1
    by_hidden_state = -(-tokens * hidden_size // intermediate_size)
    return min(tokens, max(MIN_AUTO_TILE_TOKENS, min(hidden_size, by_hidden_state)))


def _check_tile(tile_tokens: object) -> TileTokens:
    if tile_tokens == "auto":
        return "auto"
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive int (tokens per tile) or 'auto', got "
                         f"{tile_tokens!r}; e.g. enable_tiling(model, 1024).")
    return tile_tokens


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


def run_tiles(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int,
              ) -> torch.Tensor:
    """``run`` applied to ``x`` tile by tile along its flattened leading (token) dimensions.

    ``run`` must act on each token (row of the last dimension) alone, as an MLP does.
    """
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n <= tile:  # one tile: its output is the result, no copy
        y = run(flat)
        return y.view(*x.shape[:-1], y.shape[-1])
    out: torch.Tensor | None = None
    for start in range(0, n, tile):
        y = run(flat[start:start + tile])
        if out is None:
            out = y.new_empty((n, y.shape[-1]))
        out[start:start + y.shape[0]].copy_(y)
        del y  # free this tile's output before the next tile runs
    assert out is not None
    return out.view(*x.shape[:-1], out.shape[-1])


class TiledMLPFunction(torch.autograd.Function):
    """``run(x)`` in tiles; backward recomputes tile by tile and returns summed param grads.

    ``apply(run, tile, x, *params)``: ``params`` are the trainable tensors ``run`` uses.
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], tile: int,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # Autograd runs this under no_grad: each tile's intermediates die with the tile.
        ctx.run, ctx.tile, ctx.params = run, tile, params
        ctx.rng = _Rng.capture(x.device)
        ctx.autocast = _autocast_states(x.device)
        ctx.save_for_backward(x)  # the only activation kept (a checkpoint frame may pack it)
        return run_tiles(run, x, tile)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        flat = x.reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        n, tile = flat.shape[0], ctx.tile
        acc: dict[int, torch.Tensor] = {}
        with ctx.rng.forked(), _autocast(ctx.autocast), torch.enable_grad():
            if n <= tile:  # one tile: its input grad is the result, no buffer and no copy
                grad_x, _ = _backward_tile(ctx, flat, g, want_x, wanted, acc, ctx.rng)
            else:
                grad_x = torch.empty_like(flat) if want_x else None
                rng = ctx.rng
                for start in range(0, n, tile):
                    gx, rng = _backward_tile(ctx, flat[start:start + tile],
                                             g[start:start + tile], want_x, wanted, acc, rng)
                    if grad_x is not None:
                        grad_x[start:start + tile].copy_(gx)
                    del gx  # before the next tile is recomputed
        param_grads = [acc[i].to(p.dtype) if i in acc else None for i, p in enumerate(ctx.params)]
        return (None, None, None if grad_x is None else grad_x.view_as(x), *param_grads)


def _backward_tile(ctx: Any, xt: torch.Tensor, gt: torch.Tensor, want_x: bool, wanted: list[int],
                   acc: dict[int, torch.Tensor], rng: _Rng) -> tuple[torch.Tensor | None, _Rng]:
    """Recompute one tile (input rows ``xt``, output grad ``gt``) and backpropagate it.

    Its parameter grads are added to ``acc``. Returns its input grad (``None`` unless
    ``want_x``) and the RNG state the next tile started from in forward. A function of its
    own so that the tile's graph and grads are freed when it returns.
    """
    rng.restore()  # this tile draws what it drew in forward
    xt = xt.detach().requires_grad_(want_x)
    yt = ctx.run(xt)
    after = _Rng.capture(xt.device)
    inputs = ([xt] if want_x else []) + [ctx.params[i] for i in wanted]
    grads = (list(torch.autograd.grad(yt, inputs, gt, allow_unused=True))
             if yt.requires_grad else [None] * len(inputs))
    del yt  # the tile's graph: free it before the grads are summed
    gx = grads.pop(0) if want_x else None
    if want_x and gx is None:  # the output does not depend on the input
        gx = torch.zeros_like(xt)
    _accumulate(acc, wanted, grads)
    return gx, after


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


def tiled_forward_for(mlp: nn.Module, original: Callable[..., torch.Tensor],
                      tile_tokens: TileTokens) -> Callable[[torch.Tensor], torch.Tensor]:
    """The replacement ``forward`` of ``mlp`` (whose own forward is ``original``)."""
    intermediate = intermediate_size_of(mlp) if tile_tokens == "auto" else 0

    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // max(x.shape[-1], 1)
        tile = (auto_tile_tokens(x.shape[-1], intermediate, tokens) if tile_tokens == "auto"
                else tile_tokens)
        if tokens == 0:
            return original(x)
        if not torch.is_grad_enabled():  # evaluation / generation: tiles, nothing kept
            return run_tiles(original, x, tile)
        params = list({id(p): p for p in mlp.parameters() if p.requires_grad}.values())
        return TiledMLPFunction.apply(original, tile, x, *params)

    setattr(forward, _TILED_MARK, True)
    forward.__tightfit_original__ = original  # type: ignore[attr-defined]
    return forward


def intermediate_size_of(mlp: nn.Module) -> int:
    """The MLP's inner width: its ``intermediate_size``, else its gate projection's outputs."""
    size = getattr(mlp, "intermediate_size", None) or getattr(mlp.gate_proj, "out_features", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"cannot tell the intermediate size of {type(mlp).__name__} (no "
                         "intermediate_size, no gate_proj.out_features) for tile_tokens='auto'; "
                         "pass tile_tokens=<tokens per tile>.")
    return size


# -- enable / disable -----------------------------------------------------------------------


def _find_mlps(model: nn.Module, modules: str, blocks: Sequence[nn.Module] | None,
               auto: bool) -> list[nn.Module]:
    """The ``modules`` child of every block, each checked to be a gate/up/down MLP (whose
    intermediate size is known, for an ``auto`` tile)."""
    if not isinstance(modules, str) or not modules.isidentifier():
        raise ValueError(f"modules must name the MLP child of each block (e.g. 'mlp'), got "
                         f"{modules!r}.")
    chain = resolve_blocks(model, blocks)
    mlps: list[nn.Module] = []
    for i, block in enumerate(chain):
        mlp = getattr(block, modules, None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(
                f"block {i} ({type(block).__name__}) has no {modules!r} submodule, so there is "
                f"no MLP to tile; pass modules=<the name of its MLP child> (children: "
                f"{[n for n, _ in block.named_children()]}).")
        missing = [p for p in PROJECTIONS if not isinstance(getattr(mlp, p, None), nn.Module)]
        if missing:
            raise ValueError(
                f"block {i}'s {modules} ({type(mlp).__name__}) is not a gate/up/down MLP: it "
                f"lacks {missing}. Tiling supports Llama-family MLPs (down(act(gate(x)) * "
                f"up(x)), per token); its children are {[n for n, _ in mlp.named_children()]}.")
        if getattr(mlp.__dict__.get("forward"), _TILED_MARK, False):
            raise ValueError(f"block {i}'s {modules} is already tiled (through another wrapper "
                             "of this model); call disable_tiling on the model you enabled it on.")
        if auto:
            intermediate_size_of(mlp)
        mlps.append(mlp)
    return mlps


def _attention_notes(model: nn.Module) -> tuple[str, ...]:
    """What in the model's attention tiling does not bound (it is O(T²), not O(T))."""
    config = getattr(model, "config", None)
    notes: list[str] = []
    impl = getattr(config, "_attn_implementation", None)
    if impl == "eager":
        notes.append("attn_implementation='eager' builds T×T attention weights per head; load "
                     "the model with attn_implementation='sdpa' for memory-efficient attention.")
    if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0 and model.training:
        notes.append("attention_dropout > 0: torch's CPU flash-attention kernel has no dropout, "
                     "so SDPA falls back to the math kernel with T×T weights per head on the "
                     "CPU (CUDA's kernels support dropout).")
    return tuple(notes)


def enable_tiling(model: nn.Module, tile_tokens: TileTokens = "auto", *, modules: str = "mlp",
                  blocks: Sequence[nn.Module] | None = None) -> Tiling:
    """Run every block's MLP in tiles of ``tile_tokens`` tokens, forward and backward.

    Args:
        model: An HF Llama-family causal LM (peft-wrapped or not, 4-bit base or not), or any
            model whose blocks have a gate/up/down MLP child acting on each token alone.
        tile_tokens: Tokens per tile (along the flattened ``batch · seq`` tokens), or
            ``"auto"``: :func:`auto_tile_tokens`, per call (from the batch's tokens).
        modules: The name of the MLP child of each block.
        blocks: The chain of layers; found automatically when ``None``.

    Returns:
        The installed :class:`Tiling`. Calling it again replaces it.

    Raises:
        ValueError: A bad ``tile_tokens``, no blocks, a block without that child, or a child
            that is not a gate/up/down MLP. The model is left unchanged.
    """
    tile = _check_tile(tile_tokens)
    previous = model.__dict__.get(STATE_ATTR)
    if isinstance(previous, _Installed):  # re-enabling: the check below must not see our patch
        disable_tiling(model)
    try:
        mlps = _find_mlps(model, modules, blocks, tile == "auto")
    except BaseException:
        if isinstance(previous, _Installed):
            _install(model, previous.mlps, previous.info)
        raise
    return _install(model, mlps, Tiling(tile, modules, len(mlps), _attention_notes(model)))


def _install(model: nn.Module, mlps: list[nn.Module], info: Tiling) -> Tiling:
    saved = [m.__dict__.get("forward", _MISSING) for m in mlps]
    for m in mlps:
        m.forward = tiled_forward_for(m, m.forward, info.tile_tokens)
    object.__setattr__(model, STATE_ATTR, _Installed(info, mlps, saved))
    return info


def disable_tiling(model: nn.Module) -> Tiling | None:
    """Undo :func:`enable_tiling` exactly; return what was installed (``None`` if nothing)."""
    state = model.__dict__.get(STATE_ATTR)  # not getattr: a PeftModel forwards attributes
    if not isinstance(state, _Installed):
        return None
    for mlp, fwd in zip(state.mlps, state.saved_forwards):
        if fwd is _MISSING:
            mlp.__dict__.pop("forward", None)
        else:
            mlp.forward = fwd
    object.__delattr__(model, STATE_ATTR)
    return state.info


def tiling_of(model: nn.Module) -> Tiling | None:
    """The :class:`Tiling` installed on ``model`` (``None`` if none)."""
    state = model.__dict__.get(STATE_ATTR)
    return state.info if isinstance(state, _Installed) else None
