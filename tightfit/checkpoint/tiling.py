"""Tiled MLPs: each decoder layer's MLP runs in tiles of tokens, forward and backward.

At long sequence length an MLP's gate/up/activation intermediates (``tokens × intermediate``
each, plus their LoRA and dropout companions; a MoE layer's per routed pair) are the widest
tensors of the layer. :func:`enable_tiling` patches the ``mlp`` child of every block (found
by :func:`~tightfit.model.blocks.find_blocks`): a gate/up/down MLP (Llama family), Phi-3's
fused gate_up MLP, or the *experts* call of a MoE block (Mixtral, Qwen3-MoE, gpt-oss; the
router runs untiled, so router logits and the load-balancing loss are the untiled ones), as
:mod:`tightfit.checkpoint.mlp_kinds` finds them, so that:

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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tightfit.checkpoint.mlp_kinds import (
    EXPERTS,
    PROJECTIONS,
    TileTarget,
    describe_refusal,
    experts_arguments,
    tile_target,
)
from tightfit.checkpoint.tiled_function import TiledMLPFunction, run_tiles
from tightfit.model.blocks import resolve_blocks

__all__ = ["PROJECTIONS", "TiledMLPFunction", "Tiling", "auto_tile_tokens", "disable_tiling",
           "enable_tiling", "intermediate_size_of", "run_tiles", "tiled_experts_forward_for",
           "tiled_forward_for", "tiling_of"]

STATE_ATTR = "_tightfit_tiling"
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
        kinds: Each tiled layer's kind of MLP (:data:`tightfit.checkpoint.mlp_kinds.KINDS`:
            ``"gate_up_down"``, ``"fused_gate_up"`` or ``"experts"``).
    """

    tile_tokens: TileTokens
    modules: str
    layers: int
    notes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()


@dataclass
class _Installed:
    info: Tiling
    targets: list[TileTarget]
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


def _trainable(module: nn.Module) -> list[torch.Tensor]:
    return list({id(p): p for p in module.parameters() if p.requires_grad}.values())


def tiled_forward_for(mlp: nn.Module, original: Callable[..., torch.Tensor],
                      tile_tokens: TileTokens) -> Callable[[torch.Tensor], torch.Tensor]:
    """The replacement ``forward`` of a per-token ``mlp`` (gate/up/down or fused gate_up),
    whose own forward is ``original``."""
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
        return TiledMLPFunction.apply(original, tile, 1, x, *_trainable(mlp))

    setattr(forward, _TILED_MARK, True)
    forward.__tightfit_original__ = original  # type: ignore[attr-defined]
    return forward


def tiled_experts_forward_for(target: TileTarget, original: Callable[..., torch.Tensor],
                              tile_tokens: TileTokens) -> Callable[..., torch.Tensor]:
    """The replacement ``forward`` of a MoE block's experts (``target.module``): the tokens
    with their top-k expert indices and routing weights, tile by tile."""
    intermediate = (target.intermediate or 0) if tile_tokens == "auto" else 0
    experts, owner = target.module, target.owner

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if getattr(owner, "experts", None) is not experts:
            raise RuntimeError(
                f"the tiled experts of {type(owner).__name__} were wrapped again after tiling "
                "was enabled (e.g. LoRA added afterwards), so the recompute would miss the "
                "wrapper; call disable_tiling(model) and enable_tiling(model) again after "
                "adding the adapters.")
        hidden, index, weights = experts_arguments(target, args, kwargs)
        tokens = hidden.numel() // max(hidden.shape[-1], 1)
        if tokens == 0:
            return original(hidden, index, weights)
        # each token sends k rows through the experts: k × an expert's width per token
        tile = (auto_tile_tokens(hidden.shape[-1], intermediate * index.shape[-1], tokens)
                if tile_tokens == "auto" else tile_tokens)
        if not torch.is_grad_enabled():
            return run_tiles(original, (hidden, index, weights), tile)
        return TiledMLPFunction.apply(original, tile, 3, hidden, index, weights,
                                      *_trainable(experts))

    setattr(forward, _TILED_MARK, True)
    forward.__tightfit_original__ = original  # type: ignore[attr-defined]
    return forward


def intermediate_size_of(mlp: nn.Module) -> int:
    """The MLP's inner width (an expert's, for a MoE block): its ``intermediate_size``, else
    what its projections or its experts' config say."""
    target = tile_target(mlp)
    size = target.intermediate if target is not None else None
    if size is None:
        raise ValueError(f"cannot tell the intermediate size of {type(mlp).__name__} (no "
                         "intermediate_size, no gate_proj / gate_up_proj out_features, no "
                         "experts intermediate size) for tile_tokens='auto'; pass "
                         "tile_tokens=<tokens per tile>.")
    return size


# -- enable / disable -----------------------------------------------------------------------


def _find_targets(model: nn.Module, modules: str, blocks: Sequence[nn.Module] | None,
                  auto: bool) -> list[TileTarget]:
    """The tiled module of the ``modules`` child of every block, each checked to be a kind
    of MLP tiling knows (:mod:`tightfit.checkpoint.mlp_kinds`) whose intermediate size is
    known, for an ``auto`` tile."""
    if not isinstance(modules, str) or not modules.isidentifier():
        raise ValueError(f"modules must name the MLP child of each block (e.g. 'mlp'), got "
                         f"{modules!r}.")
    chain = resolve_blocks(model, blocks)
    targets: list[TileTarget] = []
    for i, block in enumerate(chain):
        mlp = getattr(block, modules, None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(
                f"block {i} ({type(block).__name__}) has no {modules!r} submodule, so there is "
                f"no MLP to tile; pass modules=<the name of its MLP child> (children: "
                f"{[n for n, _ in block.named_children()]}).")
        target = tile_target(mlp)
        if target is None:
            raise ValueError(f"block {i}'s {modules}: {describe_refusal(mlp)}.")
        if getattr(target.module.__dict__.get("forward"), _TILED_MARK, False):
            raise ValueError(f"block {i}'s {modules} is already tiled (through another wrapper "
                             "of this model); call disable_tiling on the model you enabled it on.")
        if auto and target.intermediate is None:
            intermediate_size_of(mlp)  # raises, naming the fix
        targets.append(target)
    return targets


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
        model: An HF causal LM (peft-wrapped or not, 4-bit base or not) whose blocks' MLPs
            act on each token alone: gate/up/down (Llama family), fused gate_up (Phi-3) or a
            MoE block with fused experts (Mixtral, Qwen3-MoE, gpt-oss; the experts call is
            tiled, the router is not: :mod:`tightfit.checkpoint.mlp_kinds`). With LoRA on
            MoE experts, enable tiling after the adapters are added.
        tile_tokens: Tokens per tile (along the flattened ``batch · seq`` tokens), or
            ``"auto"``: :func:`auto_tile_tokens`, per call (from the batch's tokens; for
            experts the intermediate width is an expert's times the top-k).
        modules: The name of the MLP child of each block.
        blocks: The chain of layers; found automatically when ``None``.

    Returns:
        The installed :class:`Tiling`. Calling it again replaces it.

    Raises:
        ValueError: A bad ``tile_tokens``, no blocks, a block without that child, or a child
            that is none of the kinds above. The model is left unchanged.
    """
    tile = _check_tile(tile_tokens)
    previous = model.__dict__.get(STATE_ATTR)
    if isinstance(previous, _Installed):  # re-enabling: the check below must not see our patch
        disable_tiling(model)
    try:
        targets = _find_targets(model, modules, blocks, tile == "auto")
    except BaseException:
        if isinstance(previous, _Installed):
            _install(model, previous.targets, previous.info)
        raise
    info = Tiling(tile, modules, len(targets), _attention_notes(model),
                  tuple(t.kind for t in targets))
    return _install(model, targets, info)


def _install(model: nn.Module, targets: list[TileTarget], info: Tiling) -> Tiling:
    saved = [t.module.__dict__.get("forward", _MISSING) for t in targets]
    for t in targets:
        m = t.module
        m.forward = (tiled_experts_forward_for(t, m.forward, info.tile_tokens)
                     if t.kind == EXPERTS else tiled_forward_for(m, m.forward, info.tile_tokens))
    object.__setattr__(model, STATE_ATTR, _Installed(info, targets, saved))
    return info


def disable_tiling(model: nn.Module) -> Tiling | None:
    """Undo :func:`enable_tiling` exactly; return what was installed (``None`` if nothing)."""
    state = model.__dict__.get(STATE_ATTR)  # not getattr: a PeftModel forwards attributes
    if not isinstance(state, _Installed):
        return None
    for target, fwd in zip(state.targets, state.saved_forwards):
        if fwd is _MISSING:
            target.module.__dict__.pop("forward", None)
        else:
            target.module.forward = fwd
    object.__delattr__(model, STATE_ATTR)
    return state.info


def tiling_of(model: nn.Module) -> Tiling | None:
    """The :class:`Tiling` installed on ``model`` (``None`` if none)."""
    state = model.__dict__.get(STATE_ATTR)
    return state.info if isinstance(state, _Installed) else None
