"""The matmul work of a training step, in multiply-accumulates (MACs) per token.

A decoder layer's forward: its linears (Σ in·out) plus its causal attention (QKᵀ and PV over
seq/2 keys on average: seq·q); the head's: V·h. With a frozen base, backward computes input
gradients only, so it costs about one forward: a plain step is ≈ 2 forwards. The recompute
fraction (what checkpointing, the chunked loss and the tiled MLP add) and the slowdown
estimate (:mod:`tightfit.planner.speed`) are ratios of this work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit.planner.train_setup import RECOMPUTED

if TYPE_CHECKING:
    from tightfit.checkpoint.plan import Segment
    from tightfit.planner.presets import ModelShape
    from tightfit.planner.train_setup import TrainSetup

_MLP = ("gate_proj", "up_proj", "down_proj")


def layer_macs(shape: ModelShape, setup: TrainSetup) -> int:
    """MACs per token of one decoder layer's forward: its linears and causal attention."""
    return sum(fi * fo for fi, fo in shape.linear_shapes().values()) + setup.seq_len * shape.q_size


def mlp_macs(shape: ModelShape) -> int:
    """MACs per token of one layer's MLP (gate, up, down)."""
    return sum(fi * fo for n, (fi, fo) in shape.linear_shapes().items() if n in _MLP)


def step_macs(shape: ModelShape, setup: TrainSetup) -> int:
    """MACs per token of one forward of the whole model (layers + head)."""
    return shape.layers * layer_macs(shape, setup) + shape.vocab * shape.hidden


def recompute_fraction(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...]) -> float:
    """Recomputed forward work ÷ the work of a step without checkpointing (≈ 2 forwards).

    Every checkpointed layer runs its forward once more; the chunked loss one more head
    forward; a tiled MLP (:mod:`tightfit.checkpoint.tiling`) one more MLP forward per layer
    (its backward recomputes each tile).
    """
    recomputed = sum(len(seg) for seg in segments if seg.kind in RECOMPUTED)
    work = recomputed * layer_macs(shape, setup)
    if setup.loss_chunk_tokens is not None:
        work += shape.vocab * shape.hidden
    if setup.mlp_tile is not None:
        work += shape.layers * mlp_macs(shape)
    return work / (2 * step_macs(shape, setup))
