"""How much slower a configuration's step is: an estimate, for ranking the ladder's rows.

Work is counted as :mod:`tightfit.planner.work` counts it (MACs per token; a plain step ≈ 2
forwards). On top of a plain step:

* recompute: every checkpointed layer's forward once more (every-layer checkpointing ≈ +50 %);
  the chunked loss one more head forward; a tiled MLP one more MLP forward per layer;
* 4-bit / int8 matmuls cost ``QUANT_SLOWDOWN`` × the 16-bit ones (an assumption);
* paging: the host-resident optimizer state crosses the link twice per step (in the
  optimizer step, which no compute hides);
* paged weights: each streamed layer's NF4 weights cross the link in forward and in
  backward, behind the layer before it (:mod:`tightfit.planner.paged_weights`);
* offload: each offloaded byte crosses the link twice (out in forward, back in backward),
  behind compute: a segment's input is copied while the segment runs forward and brought
  back while the segment after it runs backward (a recompute + a backward ≈ 2 forwards);
  only what the compute does not hide counts.

Times are FLOPs at ``gpu_tflops`` and bytes at ``link_gbps``; all relative to plain bf16 LoRA
without checkpointing. Ratios, not timings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit.planner.activations import layer_input_bytes, layer_saved_bytes
from tightfit.planner.paged_weights import exposed_seconds as weights_exposed_seconds
from tightfit.planner.train_setup import OFFLOADED, RECOMPUTED
from tightfit.planner.work import layer_macs, step_macs

if TYPE_CHECKING:
    from tightfit.planner.estimate import Estimate
    from tightfit.planner.presets import ModelShape
    from tightfit.planner.train_setup import TrainSetup

# Assumed cost ratios (see module doc); stated in every printed plan.
QUANT_SLOWDOWN = {"none": 1.0, "nf4": 1.15, "int8": 1.3}
DEFAULT_LINK_GBPS = 20.0  # host <-> device, PCIe 4.0 x16 in practice
DEFAULT_GPU_TFLOPS = 100.0  # effective bf16 matmul throughput of a training step
def step_seconds(shape: ModelShape, setup: TrainSetup, gpu_tflops: float) -> float:
    """Compute time of a plain step (2 forwards, 2 FLOPs per MAC) at ``gpu_tflops``."""
    return 2 * 2 * setup.tokens * step_macs(shape, setup) / (gpu_tflops * 1e12)


def offload_exposed_seconds(shape: ModelShape, est: Estimate, *, gpu_tflops: float,
                            link_gbps: float) -> float:
    """Seconds of offload traffic per step that the compute beside it does not hide."""
    setup = est.setup
    layer_s = 2 * setup.tokens * layer_macs(shape, setup) / (gpu_tflops * 1e12)
    link = link_gbps * 1e9
    exposed = 0.0
    for seg in est.segments:
        if seg.kind not in OFFLOADED:
            continue
        if seg.kind in RECOMPUTED:  # the input, once per segment
            moved, copies = layer_input_bytes(shape, setup), 1
            hide_fwd, hide_bwd = len(seg) * layer_s, 2 * len(seg) * layer_s
        else:  # saved tensors, layer by layer (a stored layer's backward ≈ one forward)
            moved, copies = layer_saved_bytes(shape, setup), len(seg)
            hide_fwd = hide_bwd = layer_s
        exposed += copies * (max(0.0, moved / link - hide_fwd) + max(0.0, moved / link - hide_bwd))
    return exposed


def slowdown(shape: ModelShape, est: Estimate, *, gpu_tflops: float = DEFAULT_GPU_TFLOPS,
             link_gbps: float = DEFAULT_LINK_GBPS) -> tuple[float, int]:
    """``(step time ÷ plain bf16 LoRA step time, paging bytes per step)`` — an estimate."""
    setup = est.setup
    compute = QUANT_SLOWDOWN[setup.quant] * (1.0 + est.recompute_fraction)
    paging = 2 * est.optimizer_offloaded
    step_s = step_seconds(shape, setup, gpu_tflops)
    moving = paging / (link_gbps * 1e9) + offload_exposed_seconds(
        shape, est, gpu_tflops=gpu_tflops, link_gbps=link_gbps)
    moving += weights_exposed_seconds(shape, setup, est.segments, gpu_tflops=gpu_tflops,
                                      link_gbps=link_gbps)
    return compute + moving / step_s, paging
