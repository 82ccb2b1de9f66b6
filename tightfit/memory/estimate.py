"""The analytic memory model: bytes of every piece of a LoRA / QLoRA training step.

Given a :class:`~tightfit.memory.presets.ModelShape` and a :class:`TrainSetup`, predict in
bytes what a step keeps on the device: base weights by storage type, the quantization
constants exactly as bitsandbytes stores them, the LoRA adapters, their gradients, the
optimizer state (and how much of it is resident under a paged budget), the activation peak
of forward + backward under a checkpoint plan, the LM head + loss buffers, and an overhead
margin. The activation formulas live in :mod:`tightfit.memory.activations`.

Where a formula comes from an implementation detail (which tensors autograd saves, what
bitsandbytes allocates) the docstring says so; ``tightfit plan --verify`` and the tests
compare every piece against a real step measured with :class:`~tightfit.memory.MemoryTracker`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from tightfit.memory.presets import ModelShape

if TYPE_CHECKING:
    import torch

DtypeName = Literal["fp32", "bf16", "fp16"]
QuantName = Literal["none", "int8", "nf4"]
OptimizerName = Literal["adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ALL_LINEAR: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
GiB = 1024**3
MiB = 1024**2

# bitsandbytes storage constants (bitsandbytes/functional.py, bitsandbytes/optim/optimizer.py)
NF4_CODE_BYTES = 16 * 4  # the 16-entry NF4 code, fp32, one per quantized weight
DQ_CODE_BYTES = 256 * 4  # the 8-bit dynamic map of the second-level quantization, per weight
DQ_BLOCKSIZE = 256  # blocksize of the second-level (absmax) quantization
OPT8_BLOCKSIZE = 256  # blockwise 8-bit optimizer state: one fp32 absmax per 256 values
OPT8_MIN_SIZE = 4096  # bnb keeps 32-bit state for tensors with fewer elements than this


@dataclass(frozen=True)
class TrainSetup:
    """One way to fine-tune: which memory pieces are on, and the batch.

    Attributes:
        seq_len: Tokens per sequence.
        batch: Sequences per step (micro-batch).
        compute_dtype: Dtype of activations and unquantized weights.
        quant: Storage of the decoder layers' linear weights (embeddings, head and norms
            always stay in ``compute_dtype``).
        double_quant: NF4 constants quantized again (8-bit absmax + fp32 per 256 blocks).
        blocksize: NF4 block size (values per fp32 absmax).
        lora_r: LoRA rank.
        lora_targets: Linear layers of each decoder layer that get adapters.
        lora_dropout: Dropout on the adapter input (> 0 saves a mask and a copy per target).
        adapter_dtype: Dtype of the adapters; peft keeps them in fp32 by default
            (``autocast_adapter_dtype``), which makes each adapter save an fp32 copy of its
            input when the compute dtype is 16-bit.
        checkpoint: ``none``, ``every``, ``sqrt``, ``uniform:k`` or ``budget``.
        checkpoint_budget: Activation bytes for ``budget`` (layers + head/loss).
        optimizer: Optimizer of the trainable (LoRA) parameters.
        optimizer_device_budget: Device bytes a paged optimizer may keep resident
            (``None``: all of it).
        loss_chunk_tokens: Tokens per chunk of the chunked LM head + loss (``None``: the
            unchunked HF loss).
        keep_logits: The caller keeps the model output (and so the logits) alive through
            backward, as ``out = model(...); out.loss.backward()`` does.
    """

    seq_len: int = 2048
    batch: int = 1
    compute_dtype: DtypeName = "bf16"
    quant: QuantName = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEAR
    lora_dropout: float = 0.0
    adapter_dtype: DtypeName = "fp32"
    checkpoint: str = "none"
    checkpoint_budget: int | None = None
    optimizer: OptimizerName = "adamw"
    optimizer_device_budget: int | None = None
    loss_chunk_tokens: int | None = None
    keep_logits: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch", "lora_r", "blocksize"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        for name in ("compute_dtype", "adapter_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {list(DTYPE_BYTES)}, got {getattr(self, name)!r}.")
        if self.quant not in ("none", "int8", "nf4"):
            raise ValueError(f"quant must be 'none', 'int8' or 'nf4', got {self.quant!r}.")
        if self.optimizer not in ("adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"):
            raise ValueError(
                f"optimizer must be adamw, adamw8bit, paged_adamw or paged_adamw8bit, got "
                f"{self.optimizer!r}."
            )
        bad = [t for t in self.lora_targets if t not in ALL_LINEAR]
        if bad or not self.lora_targets:
            raise ValueError(
                f"lora_targets {bad or '()'} not understood; choose from {', '.join(ALL_LINEAR)}."
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1 or None, got {self.loss_chunk_tokens}.")
        from tightfit.memory.activations import parse_policy

        parse_policy(self.checkpoint)
        if self.checkpoint == "budget" and (self.checkpoint_budget or 0) <= 0:
            raise ValueError("checkpoint='budget' needs checkpoint_budget=<bytes> > 0.")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch

    @property
    def d(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def a(self) -> int:
        """Bytes per element of the adapters."""
        return DTYPE_BYTES[self.adapter_dtype]

    @property
    def paged(self) -> bool:
        return self.optimizer.startswith("paged")

    def with_(self, **changes: object) -> TrainSetup:
        """A copy with some fields changed."""
        return replace(self, **changes)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a short dtype name (``"bf16"`` → ``torch.bfloat16``); torch is
    imported on first use, so the memory model itself stays torch-free."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


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


def base_weight_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(weights, constants)`` bytes of the frozen base model.

    Decoder linear weights are stored per ``setup.quant`` (NF4: two values per byte; int8:
    one byte, with an fp32 scale per output row counted as a constant); embeddings, the LM
    head (unless tied), norms and biases stay in the compute dtype.
    """
    d = setup.d
    weights = constants = 0
    for fan_in, fan_out in shape.linear_shapes().values():
        n = fan_in * fan_out
        if setup.quant == "nf4":
            weights += (n + 1) // 2
            constants += nf4_constant_bytes(n, double_quant=setup.double_quant,
                                            blocksize=setup.blocksize)
        elif setup.quant == "int8":
            weights += n
            constants += 4 * fan_out
        else:
            weights += d * n
    weights *= shape.layers
    constants *= shape.layers
    unquantized = 2 * shape.hidden * shape.layers + shape.hidden  # norms
    if shape.qkv_bias:
        unquantized += (shape.q_size + 2 * shape.kv_size) * shape.layers
    unquantized += shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2)
    rotary = 2 * (shape.head_dim // 2) * 4  # transformers' inv_freq + original_inv_freq (fp32)
    return weights + d * unquantized + rotary, constants


def lora_param_count(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """``(parameters, tensors)`` of the LoRA adapters: r·(in + out) per targeted linear."""
    linears = shape.linear_shapes()
    per_layer = sum(setup.lora_r * (linears[t][0] + linears[t][1]) for t in setup.lora_targets)
    return per_layer * shape.layers, 2 * len(setup.lora_targets) * shape.layers


def lora_tensor_sizes(shape: ModelShape, setup: TrainSetup) -> list[int]:
    """Element counts of every LoRA tensor (A: r×in, B: out×r), layer by layer."""
    linears = shape.linear_shapes()
    one = []
    for t in setup.lora_targets:
        fan_in, fan_out = linears[t]
        one += [setup.lora_r * fan_in, setup.lora_r * fan_out]
    return one * shape.layers


def optimizer_state_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Bytes of AdamW state for the LoRA parameters.

    32-bit: ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype plus a 4-byte ``step``
    tensor per parameter (torch.optim.AdamW). 8-bit (bitsandbytes' blockwise layout): two
    uint8 states plus one fp32 absmax per 256 values each (≈2.03 B/param) and two shared
    256-entry maps; tensors under 4096 elements keep 32-bit state, as bitsandbytes does.
    """
    sizes = lora_tensor_sizes(shape, setup)
    a = setup.a
    if setup.optimizer in ("adamw", "paged_adamw"):
        return sum(2 * a * n + 4 for n in sizes)
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
    what a paged optimizer keeps on the host (and moves twice per step).
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
    segments: tuple[tuple[int, int, bool], ...] = field(default=())
    recompute_fraction: float = 0.0

    PIECES = ("weights", "constants", "lora", "grads", "optimizer", "activations",
              "logits_loss", "overhead")

    @property
    def activation_peak(self) -> int:
        return self.activations + self.logits_loss

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in self.PIECES)

    def pieces(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in self.PIECES}


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
    """
    from tightfit.memory.activations import activation_peak

    overhead = overhead or Overhead()
    weights, constants = base_weight_bytes(shape, setup)
    n_lora, _ = lora_param_count(shape, setup)
    lora = setup.a * n_lora
    grads = setup.a * n_lora
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
    )
