"""The analytic memory model: bytes of every piece of a LoRA / QLoRA training step.

Given a :class:`~tightfit.planner.presets.ModelShape` and a :class:`TrainSetup`, predict in
bytes what a step keeps on the device: base weights by storage type, the quantization
constants exactly as bitsandbytes stores them, the LoRA adapters, their gradients, the
optimizer state (and how much of it is resident under a paged budget), the activation peak
of forward + backward under a checkpoint plan, the LM head + loss buffers, and an overhead
margin. The activation formulas live in :mod:`tightfit.planner.activations`.

Where a formula comes from an implementation detail (which tensors autograd saves, what
bitsandbytes allocates) the docstring says so; ``tightfit plan --verify`` and the tests
compare every piece against a real step measured with :class:`~tightfit.measure.tracker.MemoryTracker`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tightfit.planner.paged_weights import DQ_BLOCKSIZE, weight_placement
from tightfit.planner.presets import ModelShape
from tightfit.planner.train_setup import TrainSetup

if TYPE_CHECKING:
    from tightfit.checkpoint.plan import Segment

GiB = 1024**3
MiB = 1024**2

# bitsandbytes storage constants (bitsandbytes/functional.py, bitsandbytes/optim/optimizer.py)
NF4_CODE_BYTES = 16 * 4  # the 16-entry NF4 code, fp32, one per quantized weight
DQ_CODE_BYTES = 256 * 4  # the 8-bit dynamic map of the second-level quantization, per weight
OPT8_BLOCKSIZE = 256  # blockwise 8-bit optimizer state: one fp32 absmax per 256 values
OPT8_MIN_SIZE = 4096  # bnb keeps 32-bit state for tensors with fewer elements than this


# -- weights and constants -----------------------------------------------------------


def nf4_constant_bytes(numel: int, *, double_quant: bool, blocksize: int = 64) -> int:
    """Bytes of the quantization state bitsandbytes keeps for one NF4 weight.

    Without double quantization: one fp32 absmax per ``blocksize`` values, plus the
    16-entry fp32 NF4 code. With it: the absmaxes become uint8, quantized blockwise
    (256 per block) with one fp32 absmax per block, an fp32 offset and a 256-entry fp32
    dynamic code — ≈ 8/64 + 32/(64·256) ≈ 0.127 bits per parameter instead of 0.5.
    """
    blocks = math.ceil(numel / blocksize)
    if not double_quant:
        return 4 * blocks + NF4_CODE_BYTES
    return blocks + 4 * math.ceil(blocks / DQ_BLOCKSIZE) + 4 + DQ_CODE_BYTES + NF4_CODE_BYTES


def expert_constant_bytes(numel: int, experts: int, *, double_quant: bool,
                          blocksize: int = 64) -> int:
    """Bytes of the quantization state of one MoE expert weight stack (``experts`` experts,
    ``numel`` values each), as :mod:`tightfit.qlora.experts` stores it: per expert the
    absmaxes (fp32; with DQ uint8 + an fp32 absmax per 256 blocks + an fp32 offset), and
    one NF4 code (+ one 256-entry DQ code) for the whole stack."""
    blocks = math.ceil(numel / blocksize)
    if not double_quant:
        return experts * 4 * blocks + NF4_CODE_BYTES
    per_expert = blocks + 4 * math.ceil(blocks / DQ_BLOCKSIZE) + 4
    return experts * per_expert + DQ_CODE_BYTES + NF4_CODE_BYTES


def _quantized_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(weights, constants)`` of one decoder layer's linears and experts."""
    if setup.quant == "int8" and shape.is_moe:
        raise ValueError(f"{shape.name}: int8 (LLM.int8) MoE experts are not modelled (tightfit "
                         "stores experts in NF4); choose quant='nf4' or 'none'.")
    weights = constants = 0
    for name, (fan_in, fan_out, copies) in shape.weight_shapes().items():
        n = fan_in * fan_out
        expert = name in shape.expert_shapes()
        if setup.quant == "nf4":
            weights += copies * ((n + 1) // 2)
            constants += (expert_constant_bytes(n, copies, double_quant=setup.double_quant,
                                                blocksize=setup.blocksize) if expert else
                          nf4_constant_bytes(n, double_quant=setup.double_quant,
                                             blocksize=setup.blocksize))
        elif setup.quant == "int8":
            weights += n
            constants += 4 * fan_out
        else:
            weights += setup.d * copies * n
    return weights, constants


def base_weight_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(weights, constants)`` bytes of the frozen base model.

    Decoder linear weights (and MoE experts, each expert's projection on its own) are stored
    per ``setup.quant`` (NF4: two values per byte; int8: one byte, with an fp32 scale per
    output row counted as a constant); embeddings, the LM head (unless tied), norms (q/k
    norms included), biases and MoE routers stay in the compute dtype.
    """
    d = setup.d
    weights, constants = _quantized_bytes(shape, setup)
    weights *= shape.layers
    constants *= shape.layers
    per_layer = shape.traits.norms * shape.hidden + shape.experts * shape.hidden
    if shape.traits.qk_norm:
        per_layer += 2 * shape.head_dim
    if shape.qkv_bias:
        per_layer += shape.q_size + 2 * shape.kv_size
    unquantized = per_layer * shape.layers + shape.hidden  # + the final norm
    unquantized += shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2)
    return weights + d * unquantized + rotary_buffer_bytes(shape), constants


def rotary_buffer_bytes(shape: ModelShape) -> int:
    """transformers' rotary buffers (fp32 ``inv_freq`` and ``original_inv_freq``; one pair
    per attention type where they differ, Gemma 3's local and global layers)."""
    return shape.rotary_kinds * 2 * (shape.head_dim // 2) * 4


def adapted_weights(shape: ModelShape, setup: TrainSetup) -> dict[str, tuple[int, int, int]]:
    """``(in, out, copies)`` of each weight of a layer that gets adapters.

    Raises:
        ValueError: A named target the family's layer does not have.
    """
    weights = shape.weight_shapes()
    if setup.lora_target_modules != "all-linear":
        missing = [t for t in setup.lora_target_modules if t not in weights]
        if missing:
            raise ValueError(
                f"lora_target_modules {tuple(missing)}: a {shape.family} layer of {shape.name} "
                f"has no such projection; its projections are {', '.join(weights)} (or 'all-linear')."
            )
    return {n: w for n, w in weights.items() if setup.adapts(n)}


def lora_param_count(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(parameters, tensors)`` of the LoRA adapters: r·(in + out) per targeted linear, and
    per expert of a targeted expert weight (peft's parameter targets)."""
    targets = adapted_weights(shape, setup)
    per_layer = sum(setup.lora_r * c * (fi + fo) for fi, fo, c in targets.values())
    return per_layer * shape.layers, 2 * len(targets) * shape.layers


def lora_tensor_sizes(shape: ModelShape, setup: TrainSetup) -> list[int]:
    """Element counts of every LoRA tensor (A: r×in, B: out×r; an expert weight's A is
    (r·E)×in and its B out×(r·E)), layer by layer."""
    one = []
    for fan_in, fan_out, copies in adapted_weights(shape, setup).values():
        one += [setup.lora_r * copies * fan_in, setup.lora_r * copies * fan_out]
    return one * shape.layers


def optimizer_state_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Bytes of AdamW state for the LoRA parameters.

    32-bit: ``exp_avg`` and ``exp_avg_sq`` in the state dtype (torch.optim.AdamW: the
    adapters' dtype; tightfit's paged AdamW: fp32, as bitsandbytes' ``paged_adamw_32bit``;
    :attr:`TrainSetup.state_bytes`) plus a 4-byte ``step`` tensor per parameter. 8-bit
    (bitsandbytes' blockwise layout): two uint8 states plus one fp32 absmax per 256 values
    each (≈2.03 B/param) and two shared 256-entry maps; tensors under 4096 elements keep
    32-bit state, as bitsandbytes does.
    """
    sizes = lora_tensor_sizes(shape, setup)
    if not setup.optimizer.endswith("8bit"):
        return sum(2 * setup.state_bytes * n + 4 for n in sizes)
    # qmap1, qmap2: shared by every 8-bit parameter
    total = 2 * 256 * 4 if any(n >= OPT8_MIN_SIZE for n in sizes) else 0
    for n in sizes:
        if n < OPT8_MIN_SIZE:
            total += 2 * 4 * n
        else:
            total += 2 * n + 2 * 4 * math.ceil(n / OPT8_BLOCKSIZE)
    return total


# -- the whole step ------------------------------------------------------------------


@dataclass(frozen=True)
class Overhead:
    """Device memory that is not a tensor of the step.

    Attributes:
        fixed_bytes: CUDA context, cuBLAS/cuDNN workspaces, kernels (≈0.5–1 GiB on recent
            GPUs; 0 when measuring tensors on the CPU).
        fraction: Allocator slack (fragmentation, rounding) as a fraction of the tensors.
    """

    fixed_bytes: int = 1 * GiB
    fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.fixed_bytes < 0 or not 0.0 <= self.fraction < 1.0:
            raise ValueError(
                f"overhead must be >= 0 bytes and slack in [0, 1); got {self.fixed_bytes}, "
                f"{self.fraction}."
            )

    def bytes_for(self, tensor_bytes: int) -> int:
        return self.fixed_bytes + int(self.fraction * tensor_bytes)


@dataclass(frozen=True)
class Estimate:
    """Predicted device bytes of one training step, piece by piece.

    ``activations`` is the decoder layers' share of the forward + backward peak and
    ``logits_loss`` the LM head + loss share at that same moment; their sum is the
    activation peak. ``optimizer`` is what stays on the device; ``optimizer_offloaded``
    what a paged optimizer keeps on the host (and moves twice per step);
    ``host_activations`` what offloaded segments keep on the host (moved twice per step);
    ``host_weights`` the streamed layers' NF4 weights there (``weights`` and ``constants``
    count only what stays on the device: :mod:`tightfit.planner.paged_weights`).
    ``total`` is the device's bytes, ``host`` the host's.
    """

    shape: ModelShape
    setup: TrainSetup
    weights: int
    constants: int
    lora: int
    grads: int
    optimizer: int
    optimizer_offloaded: int
    activations: int
    logits_loss: int
    overhead: int
    segments: tuple[Segment, ...] = field(default=())
    recompute_fraction: float = 0.0
    host_activations: int = 0
    host_weights: int = 0

    PIECES = ("weights", "constants", "lora", "grads", "optimizer", "activations",
              "logits_loss", "overhead")

    @property
    def activation_peak(self) -> int:
        return self.activations + self.logits_loss

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in self.PIECES)

    @property
    def host(self) -> int:
        """Host bytes of the step: offloaded activations + the optimizer's host pages."""
        return self.host_activations + self.optimizer_offloaded + self.host_weights

    @property
    def fits_host(self) -> bool:
        """``host`` within ``setup.host_budget`` (always, without a budget)."""
        return self.setup.host_budget is None or self.host <= self.setup.host_budget

    def pieces(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in self.PIECES}


def untiled_mlp(shape: ModelShape) -> str | None:
    """Why ``shape``'s MLP cannot run in tiles, ``None`` when it can:
    :mod:`tightfit.checkpoint.tiling` tiles every family's MLP (gate/up/down, Phi-3's fused
    ``gate_up_proj``, and MoE experts, whose router runs untiled)."""
    del shape  # every family planned here tiles; the question stays for those that will not
    return None


def estimate(
    shape: ModelShape, setup: TrainSetup, overhead: Overhead | None = None
) -> Estimate:
    """Predict every piece of a training step's device memory, in bytes.

    Args:
        shape: The architecture.
        setup: The memory pieces and the batch.
        overhead: Non-tensor device memory; ``Overhead()`` (1 GiB + 5 %) by default.

    Returns:
        The per-piece :class:`Estimate`.

    Raises:
        ValueError: ``setup.seq_len`` is longer than ``shape.max_positions``.
    """
    from tightfit.planner.peak import activation_peak, offloaded_bytes

    if setup.seq_len > shape.max_positions:
        raise ValueError(
            f"seq_len {setup.seq_len} is longer than {shape.name} supports "
            f"(max_position_embeddings={shape.max_positions}); pass a shorter --seq-len."
        )
    untiled = untiled_mlp(shape)
    if setup.mlp_tile is not None and untiled is not None:
        raise ValueError(
            f"{shape.name}: {untiled} (tightfit.checkpoint.tiling tiles gate/up/down MLPs); "
            "plan it untiled: mlp_tile=None (tightfit train: --mlp-tile none).")
    overhead = overhead or Overhead()
    weights, constants = base_weight_bytes(shape, setup)
    placed = weight_placement(shape, setup)  # streamed layers: in flight only
    weights, constants = weights - placed.saved_weights, constants - placed.saved_constants
    n_lora, _ = lora_param_count(shape, setup)
    lora = setup.lora_bytes * n_lora
    grads = setup.lora_bytes * n_lora
    state = optimizer_state_bytes(shape, setup)
    resident = state
    if setup.paged and setup.optimizer_device_budget is not None:
        resident = min(state, setup.optimizer_device_budget)
    layers, head, segments, recompute = activation_peak(shape, setup)
    tensors = weights + constants + lora + grads + resident + layers + head
    return Estimate(
        shape=shape,
        setup=setup,
        weights=weights,
        constants=constants,
        lora=lora,
        grads=grads,
        optimizer=resident,
        optimizer_offloaded=state - resident,
        activations=layers,
        logits_loss=head,
        overhead=overhead.bytes_for(tensors),
        segments=segments,
        recompute_fraction=recompute,
        host_activations=offloaded_bytes(shape, setup, segments),
        host_weights=placed.host_bytes,
    )
