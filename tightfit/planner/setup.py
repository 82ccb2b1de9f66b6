"""What the planner is asked about: one way to fine-tune (:class:`TrainSetup`), and its names.

The names are tightfit's own: dtypes as :mod:`tightfit.measure.dtypes` spells them (short
forms accepted), optimizers by their :mod:`tightfit.optim.registry` kind, checkpoint policies
as :mod:`tightfit.checkpoint.plan` parses them — the values ``tightfit train`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from tightfit.checkpoint.plan import parse_policy
from tightfit.measure.dtypes import DTYPE_BYTES, DtypeName, dtype_name

if TYPE_CHECKING:
    from tightfit.optim.registry import OptimizerKind

QuantName = Literal["none", "int8", "nf4"]
# Where saved activations wait for backward: on the device ("none"), checkpointed segments'
# inputs on the host ("inputs"), and also stored segments' saved tensors there ("all").
OffloadName = Literal["none", "inputs", "all"]
OFFLOADS: tuple[OffloadName, ...] = ("none", "inputs", "all")
# Segment kinds (tightfit.checkpoint.plan's names) by what they do: recomputed in backward;
# bytes waiting on the next tier (pinned host memory on CUDA) until their backward.
RECOMPUTED: tuple[str, ...] = ("checkpoint", "checkpoint_offload")
OFFLOADED: tuple[str, ...] = ("checkpoint_offload", "stored_offload")
# The registry kinds whose state the memory model counts: torch's AdamW, the paged AdamW and
# the paged 8-bit AdamW (bitsandbytes' blockwise layout). Lion, SGD, ... are not modelled.
PLANNED_OPTIMIZERS: tuple[OptimizerKind, ...] = ("adamw", "paged_adamw", "paged_adamw8bit")

ALL_LINEAR: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


@dataclass(frozen=True)
class TrainSetup:
    """One way to fine-tune: which memory pieces are on, and the batch.

    Attributes:
        seq_len: Tokens per sequence.
        batch: Sequences per step (micro-batch).
        compute_dtype: Dtype of activations and unquantized weights (``"bfloat16"``,
            ``"float16"``, ``"float32"``; the short forms ``"bf16"`` ... are stored under
            these names).
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
        checkpoint: ``none``, ``every``, ``sqrt``, ``uniform:k`` or ``budget`` (the policies
            of :mod:`tightfit.checkpoint.plan`; ``selective`` is not modelled and refused).
        checkpoint_budget: Activation bytes for ``budget`` (layers + head/loss).
        optimizer: Optimizer of the trainable (LoRA) parameters, a registry kind from
            :data:`PLANNED_OPTIMIZERS`.
        optimizer_device_budget: Device bytes a paged optimizer may keep resident
            (``None``: all of it).
        loss_chunk_tokens: Tokens per chunk of the chunked LM head + loss (``None``: the
            unchunked HF loss).
        keep_logits: The caller keeps the model output (and so the logits) alive through
            backward, as ``out = model(...); out.loss.backward()`` does.
        offload: ``"inputs"``: each checkpointed segment's input is copied to (pinned) host
            memory in forward and brought back one segment ahead of its backward, so the
            device holds only the segments in flight; ``"all"``: stored segments' saved
            tensors go to the host too (brought back one layer ahead); ``"none"``.
        mlp_tile: Tokens per tile of the tiled MLP (:mod:`tightfit.checkpoint.tiling`, tiles
            along the flattened batch × seq tokens); ``None``: the MLP is not tiled.
        host_budget: Host bytes the step may use for offloaded activations and the paged
            optimizer's host pages (``None``: not checked).
    """

    seq_len: int = 2048
    batch: int = 1
    compute_dtype: DtypeName = "bfloat16"
    quant: QuantName = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEAR
    lora_dropout: float = 0.0
    adapter_dtype: DtypeName = "float32"
    checkpoint: str = "none"
    checkpoint_budget: int | None = None
    optimizer: OptimizerKind = "adamw"
    optimizer_device_budget: int | None = None
    loss_chunk_tokens: int | None = None
    keep_logits: bool = False
    offload: OffloadName = "none"
    mlp_tile: int | None = None
    host_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch", "lora_r", "blocksize"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        for name in ("compute_dtype", "adapter_dtype"):
            # a short form ("bf16") is accepted and kept under its canonical name
            object.__setattr__(self, name, dtype_name(getattr(self, name), what=name))
        if self.quant not in ("none", "int8", "nf4"):
            raise ValueError(f"quant must be 'none', 'int8' or 'nf4', got {self.quant!r}.")
        if self.optimizer not in PLANNED_OPTIMIZERS:
            hint = (" (tightfit's 8-bit AdamW is the paged one: 'paged_adamw8bit')"
                    if self.optimizer == "adamw8bit" else "")
            raise ValueError(
                f"optimizer {self.optimizer!r} is not one the planner models{hint}; choose "
                f"{', '.join(PLANNED_OPTIMIZERS)} (tightfit train's --optimizer names)."
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
        if parse_policy(self.checkpoint)[0] == "selective":
            raise ValueError("checkpoint='selective' is not modelled by the planner; choose "
                             "none, every, sqrt, uniform:k or budget.")
        if self.checkpoint == "budget" and (self.checkpoint_budget or 0) <= 0:
            raise ValueError("checkpoint='budget' needs checkpoint_budget=<bytes> > 0.")
        self._check_long_context()

    def _check_long_context(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {self.offload!r}.")
        if self.offload == "inputs" and self.checkpoint == "none":
            raise ValueError("offload='inputs' moves checkpointed segments' inputs to the host, "
                             "and checkpoint='none' has none; choose a checkpoint policy (e.g. "
                             "'every') or offload='all' (stored segments' saved tensors).")
        for name in ("mlp_tile", "host_budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}.")

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
    def mlp_tile_tokens(self) -> int:
        """Tokens in one MLP tile (all the step's tokens when the MLP is not tiled)."""
        return self.tokens if self.mlp_tile is None else min(self.mlp_tile, self.tokens)

    @property
    def paged(self) -> bool:
        return self.optimizer.startswith("paged")

    def with_(self, **changes: object) -> TrainSetup:
        """A copy with some fields changed."""
        return replace(self, **changes)

