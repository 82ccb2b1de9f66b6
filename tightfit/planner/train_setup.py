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
from tightfit.planner.shapes import KNOWN_WEIGHTS, LLAMA_LINEARS
from tightfit.qlora.lora_compute import DEFAULT_LORA_COMPUTE, LORA_COMPUTES, LoraCompute

if TYPE_CHECKING:
    from tightfit.optim.optimizer_options import OptimizerKind

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

# The Llama layer's seven linears; "all-linear" (the default, tightfit train's too) adapts
# every projection the model's family has (Phi-3's fused ones, MoE experts' weights).
ALL_LINEAR: tuple[str, ...] = LLAMA_LINEARS


@dataclass(frozen=True)
class TrainSetup:
    """One way to fine-tune: which memory pieces are on, and the batch.

    Attributes:
        seq_len: Tokens per sequence.
        batch_size: Sequences per step (micro-batch).
        compute_dtype: Dtype of activations and unquantized weights (``"bfloat16"``,
            ``"float16"``, ``"float32"``; the short forms ``"bf16"`` ... are stored under
            these names).
        quant: Storage of the decoder layers' linear weights (embeddings, head and norms
            always stay in ``compute_dtype``).
        double_quant: NF4 constants quantized again (8-bit absmax + fp32 per 256 blocks).
        blocksize: NF4 block size (values per fp32 absmax).
        lora_r: LoRA rank.
        lora_target_modules: ``"all-linear"`` (every projection of the family, MoE experts'
            weights included, as ``tightfit train``'s default) or the names of the
            projections of each decoder layer that get adapters.
        lora_dropout: Dropout on the adapter input (> 0 saves a mask and a copy per target).
        lora_dtype: Dtype of the adapters and their gradients (``tightfit train
            --lora-dtype``); peft keeps them in fp32 by default (``autocast_adapter_dtype``);
            the QLoRA paper's scripts keep them in bf16.
        lora_compute: What the adapters' matmuls run in (``tightfit train
            --lora-compute``): ``"compute_dtype"`` (the default: their weights cast to the
            compute dtype in forward, :mod:`tightfit.qlora.lora_compute`, so an adapter saves
            the compute-dtype input the layer shares) or ``"lora_dtype"`` (peft's own: each
            adapter casts its input to ``lora_dtype`` and saves that copy, T·in·4 bytes per
            adapter for fp32 adapters in 16-bit compute).
        optimizer_state_dtype: Dtype of a 32-bit AdamW's two moments: ``"auto"`` is what
            the optimizer keeps (torch's ``adamw``: the adapters' dtype; ``paged_adamw``:
            float32 whatever the adapters', as bitsandbytes' ``paged_adamw_32bit``); a
            dtype name is checked against that (bf16 adapters with fp32 state is
            ``paged_adamw``).
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
        resident_layers: Decoder layers whose NF4 weights stay on the device (``tightfit
            train --resident-layers``); the others wait on the host and stream in one layer
            ahead (:mod:`tightfit.planner.paged_weights`); ``"all"``: nothing streams.
        fsdp_offload: On more than one GPU under FSDP2 (``tightfit train --fsdp
            --fsdp-offload``): every rank's shards (base, constants, LoRA, grads) and the
            optimizer step wait on the host (FSDP2's ``CPUOffloadPolicy``); the device holds
            the units gathered in flight (:mod:`tightfit.planner.ranks`).
    """

    seq_len: int = 2048
    batch_size: int = 1
    compute_dtype: DtypeName = "bfloat16"
    quant: QuantName = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    lora_r: int = 16
    lora_target_modules: tuple[str, ...] | Literal["all-linear"] = "all-linear"
    lora_dropout: float = 0.0
    lora_dtype: DtypeName = "float32"
    lora_compute: LoraCompute = DEFAULT_LORA_COMPUTE
    optimizer_state_dtype: DtypeName | Literal["auto"] = "auto"
    checkpoint: str = "none"
    checkpoint_budget: int | None = None
    optimizer: OptimizerKind = "adamw"
    optimizer_device_budget: int | None = None
    loss_chunk_tokens: int | None = None
    keep_logits: bool = False
    offload: OffloadName = "none"
    mlp_tile: int | None = None
    host_budget: int | None = None
    resident_layers: int | Literal["all"] = "all"
    fsdp_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "lora_r", "blocksize"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        for name in ("compute_dtype", "lora_dtype"):
            # a short form ("bf16") is accepted and kept under its canonical name
            object.__setattr__(self, name, dtype_name(getattr(self, name), what=name))
        if self.lora_compute not in LORA_COMPUTES:
            raise ValueError(f"lora_compute must be one of {', '.join(LORA_COMPUTES)}, got "
                             f"{self.lora_compute!r}; compute_dtype runs the adapters' matmuls "
                             "in the compute dtype, lora_dtype in the adapters' own.")
        if self.quant not in ("none", "int8", "nf4"):
            raise ValueError(f"quant must be 'none', 'int8' or 'nf4', got {self.quant!r}.")
        self._check_optimizer()
        targets = self.lora_target_modules
        if targets != "all-linear":
            targets = (targets,) if isinstance(targets, str) else tuple(targets)
            object.__setattr__(self, "lora_target_modules", targets)
            bad = [t for t in targets if t not in KNOWN_WEIGHTS]
            if bad or not targets:
                raise ValueError(
                    f"lora_target_modules {bad or '()'} not understood; pass 'all-linear' or "
                    f"names from {', '.join(KNOWN_WEIGHTS)}."
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

    def _check_optimizer(self) -> None:
        if self.optimizer not in PLANNED_OPTIMIZERS:
            hint = (" (tightfit's 8-bit AdamW is the paged one: 'paged_adamw8bit')"
                    if self.optimizer == "adamw8bit" else "")
            raise ValueError(
                f"optimizer {self.optimizer!r} is not one the planner models{hint}; choose "
                f"{', '.join(PLANNED_OPTIMIZERS)} (tightfit train's --optimizer names)."
            )
        if self.optimizer_state_dtype == "auto":
            return
        want = dtype_name(self.optimizer_state_dtype, what="optimizer_state_dtype (or 'auto')")
        object.__setattr__(self, "optimizer_state_dtype", want)
        keeps = {"adamw": self.lora_dtype, "paged_adamw": "float32"}.get(self.optimizer)
        if want == keeps:
            return
        if self.optimizer == "adamw":
            fix = ("for float32 state with 16-bit adapters choose optimizer='paged_adamw' "
                   "(32-bit state whatever the adapters' dtype, as bitsandbytes' "
                   "paged_adamw_32bit)" if want == "float32" else
                   f"for {want} state keep the adapters in {want} (lora_dtype)")
            raise ValueError(f"optimizer 'adamw' (torch.optim.AdamW) keeps its state in the "
                             f"adapters' dtype ({self.lora_dtype}), not {want}; {fix}.")
        what = ("8-bit state" if keeps is None else "float32 state")
        raise ValueError(f"optimizer {self.optimizer!r} keeps {what}, not {want}; leave "
                         "optimizer_state_dtype='auto', or choose optimizer='adamw' for state "
                         "in the adapters' dtype.")

    def _check_long_context(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {self.offload!r}.")
        if self.offload == "inputs" and self.checkpoint == "none":
            raise ValueError("offload='inputs' moves checkpointed segments' inputs to the host, "
                             "and checkpoint='none' has none; choose a checkpoint policy (e.g. "
                             "'every') or offload='all' (stored segments' saved tensors).")
        k = self.resident_layers
        if k != "all" and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"resident_layers must be 'all' or a number of layers >= 0, got "
                             f"{k!r}.")
        for name in ("mlp_tile", "host_budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}.")

    def adapts(self, name: str) -> bool:
        """Whether the projection ``name`` gets adapters."""
        return self.lora_target_modules == "all-linear" or name in self.lora_target_modules

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def d(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def a(self) -> int:
        """Bytes per element of what the adapters compute in, and so of what they save for
        backward: the compute dtype's with ``lora_compute="compute_dtype"``, else the
        adapters' own (their parameters and gradients: :attr:`lora_bytes`)."""
        return self.d if self.lora_compute == "compute_dtype" else self.lora_bytes

    @property
    def lora_bytes(self) -> int:
        """Bytes per element of the adapters' parameters and gradients (``lora_dtype``)."""
        return DTYPE_BYTES[self.lora_dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes per element of a 32-bit AdamW's moments (torch's AdamW: the adapters'
        dtype; the paged AdamW: fp32)."""
        return 4 if self.optimizer == "paged_adamw" else self.lora_bytes

    @property
    def state_dtype(self) -> str:
        """What the optimizer keeps its moments in: a dtype name, or ``"8-bit"``."""
        if self.optimizer.endswith("8bit"):
            return "8-bit"
        return "float32" if self.optimizer == "paged_adamw" else self.lora_dtype

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

