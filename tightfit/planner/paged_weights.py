"""Paged base weights in the plan: how many layers keep their 4-bit weights on the device.

The placement :mod:`tightfit.qlora.paged_base` runs (``tightfit train --resident-layers K``):
the last ``K`` decoder layers keep their NF4 weights on the device; every other layer's packed
codes and quantization constants wait on the host (pinned) and come back one layer ahead, in
forward and again in backward (a checkpointed layer's recompute and its backward share one
load). So, for ``S = layers - K`` streamed layers of ``w`` bytes each:

* **device**: the resident layers' weights plus the streamed layers in flight — at most two
  at once (the one running and the next) — so the device saves ``(S - min(2, S)) · w``;
* **host**: ``S · w`` pinned, counted with offloaded activations and the optimizer's pages
  against the host budget;
* **link**: ``2 · S · w`` bytes a step. A layer's load overlaps the compute of the layer
  before it: a forward in forward (``F``), a backward (+ its recompute) in backward (``G``).
  What the compute does not hide is charged, on top of what the layer's offloaded
  activations already ask of the same link: per streamed layer
  ``max(0, m + o − H) − max(0, o − H)`` for ``H`` = ``F`` and ``G``, ``m`` the weights' and
  ``o`` the activations' move time.

What pages is what ``paged_base`` moves: each linear's packed codes and absmax (and the
second-level absmax with double quantization) when at least ``MIN_BYTES``; the NF4 and
double-quant codes, the offset and MoE experts (buffers, not ``Params4bit``) stay resident.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tightfit.planner.activations import layer_input_bytes, layer_saved_bytes
from tightfit.planner.train_setup import OFFLOADED, RECOMPUTED
from tightfit.planner.work import layer_macs
from tightfit.qlora.paged_base import MIN_BYTES

if TYPE_CHECKING:
    from tightfit.checkpoint.plan import Segment
    from tightfit.planner.presets import ModelShape
    from tightfit.planner.train_setup import TrainSetup

IN_FLIGHT = 2  # streamed layers on the device at once (paged_base's schedule)
DQ_BLOCKSIZE = 256  # blocksize of bitsandbytes' second-level (absmax) quantization


def paged_layer_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(weights, constants)`` bytes of one decoder layer that page (0 unless NF4)."""
    if setup.quant != "nf4":
        return 0, 0
    experts = shape.expert_shapes()
    weights = constants = 0
    for name, (fan_in, fan_out, copies) in shape.weight_shapes().items():
        if name in experts:
            continue  # experts' 4-bit storage is buffers: resident
        n = fan_in * fan_out
        blocks = math.ceil(n / setup.blocksize)
        pieces = [blocks if setup.double_quant else 4 * blocks]
        if setup.double_quant:
            pieces.append(4 * math.ceil(blocks / DQ_BLOCKSIZE))
        packed = (n + 1) // 2
        weights += copies * (packed if packed >= MIN_BYTES else 0)
        constants += copies * sum(p for p in pieces if p >= MIN_BYTES)
    return weights, constants


@dataclass(frozen=True)
class WeightPlacement:
    """Where a setup's decoder-layer weights live (``resident_layers`` of ``layers``)."""

    layers: int
    resident_layers: int
    layer_weights: int  # one layer's paged codes
    layer_constants: int  # one layer's paged absmax

    @property
    def streamed(self) -> int:
        return self.layers - self.resident_layers

    @property
    def layer_bytes(self) -> int:
        return self.layer_weights + self.layer_constants

    @property
    def in_flight(self) -> int:
        """Streamed layers on the device at once."""
        return min(IN_FLIGHT, self.streamed)

    @property
    def saved_weights(self) -> int:
        """Device bytes of codes the placement frees."""
        return (self.streamed - self.in_flight) * self.layer_weights

    @property
    def saved_constants(self) -> int:
        """Device bytes of constants the placement frees."""
        return (self.streamed - self.in_flight) * self.layer_constants

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes of the streamed layers' weights."""
        return self.streamed * self.layer_bytes

    @property
    def moved_per_step(self) -> int:
        """Bytes over the link a step (each streamed layer in forward and in backward)."""
        return 2 * self.streamed * self.layer_bytes


def weight_placement(shape: ModelShape, setup: TrainSetup) -> WeightPlacement:
    """The placement ``setup.resident_layers`` asks for (``"all"``: nothing streams)."""
    weights, constants = paged_layer_bytes(shape, setup)
    k = setup.resident_layers
    resident = shape.layers if k == "all" else min(int(k), shape.layers)
    return WeightPlacement(shape.layers, resident, weights, constants)


def _offload_seconds(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...],
                     link: float) -> list[float]:
    """Per layer, the seconds its offloaded activations take on the link one way."""
    out = [0.0] * shape.layers
    for seg in segments:
        if seg.kind not in OFFLOADED:
            continue
        if seg.kind in RECOMPUTED:  # the input, once per segment: spread over its layers
            each = layer_input_bytes(shape, setup) / len(seg) / link
        else:
            each = layer_saved_bytes(shape, setup) / link
        for i in range(seg.start, min(seg.stop, shape.layers)):
            out[i] = each
    return out


def exposed_seconds(shape: ModelShape, setup: TrainSetup, segments: tuple[Segment, ...], *,
                    gpu_tflops: float, link_gbps: float) -> float:
    """Seconds a step waits for streamed weights (the compute beside them hides the rest);
    ``segments``: the step's checkpoint plan (an estimate's)."""
    placed = weight_placement(shape, setup)
    if placed.streamed == 0 or placed.layer_bytes == 0:
        return 0.0
    link = link_gbps * 1e9
    forward_s = 2 * setup.tokens * layer_macs(shape, setup) / (gpu_tflops * 1e12)
    recomputed = [False] * shape.layers
    for seg in segments:
        for i in range(seg.start, min(seg.stop, shape.layers)):
            recomputed[i] = seg.kind in RECOMPUTED
    offload = _offload_seconds(shape, setup, segments, link)
    m = placed.layer_bytes / link
    exposed = 0.0
    for i in range(placed.streamed):  # the first layers stream, the last stay
        o = offload[i]
        for hide in (forward_s, (2 if recomputed[i] else 1) * forward_s):
            exposed += max(0.0, m + o - hide) - max(0.0, o - hide)
    return exposed


def fit_resident_layers(setup: TrainSetup, layers: int,
                        fits: Callable[[TrainSetup], bool]) -> TrainSetup:
    """``setup`` with the most resident layers for which ``fits`` holds: ``"all"`` when the
    weights do not bind, else the largest ``K < layers`` (the fewest layers streamed, the
    least link time, the fewest host bytes); ``0`` when even that does not fit (the row then
    does not fit). ``fits`` must hold for every ``K`` below one that fits (the device's
    bytes grow with ``K``)."""
    if setup.quant != "nf4" or fits(setup.with_(resident_layers="all")):
        return setup.with_(resident_layers="all")
    if not fits(setup.with_(resident_layers=0)):
        return setup.with_(resident_layers=0)
    lo, hi = 0, layers - 1  # fits(lo); find the largest fitting K in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(setup.with_(resident_layers=mid)):
            lo = mid
        else:
            hi = mid - 1
    return setup.with_(resident_layers=lo)
