"""Typed options for :func:`tightfit.prepare`: one definition feeds the API, the CLI and the docs.

Every field carries its help text in ``metadata["help"]``; ``tightfit train`` builds its
``--lora-r``/``--quant``/... flags from these dataclasses, so the two can never drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from tightfit.checkpoint.plan import OFFLOADS, OffloadMode
from tightfit.measure.dtypes import DtypeName, dtype_name, torch_dtype
from tightfit.qlora.lora_compute import DEFAULT_LORA_COMPUTE, LORA_COMPUTES, LoraCompute
from tightfit.qlora.paged_base import check_resident_layers

QuantKind = Literal["nf4", "fp4"]
# "auto" picks per device; the rest is the one dtype vocabulary (tightfit.measure.dtypes)
ComputeDtypeName = Literal["auto", DtypeName]


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters (peft) on the frozen base. One set of defaults for ``tightfit.prepare``,
    ``tightfit train`` and ``tightfit plan``: r=16 and alpha=16 as the QLoRA recipe, dropout
    0 (the paper used 0.05-0.1): a dropout keeps a mask and a dropped copy of every adapted
    input for backward, which costs long context most (``tightfit plan --model llama-3.1-8b
    --gpu 24GiB --lora-r 32 --max-seq --host-ram 128GiB``: 105,123 tokens at 0, 68,141 at
    0.05, at f95f1b9), and peft cannot drop the input of full-precision MoE experts at all.
    The adapters compute in the compute dtype on their ``dtype`` masters by default
    (``compute``, :mod:`tightfit.qlora.lora_compute`)."""

    r: int = field(default=16, metadata={"help": "LoRA rank"})
    alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    target_modules: str | tuple[str, ...] = field(
        default="all-linear",
        metadata={
            "help": "comma-separated module-name suffixes to adapt, or 'all-linear' "
            "(every linear layer and MoE expert weight except the output head)"
        },
    )
    dtype: DtypeName = field(
        default="float32",
        metadata={"help": "dtype of the adapters and their gradients: float32 (peft's default "
                          "upcast), or bfloat16/float16 as the QLoRA paper's scripts keep them "
                          "(halves their bytes; the optimizer decides its state's dtype)"},
    )
    compute: LoraCompute = field(
        default=DEFAULT_LORA_COMPUTE,
        metadata={"help": "what the LoRA matmuls run in: compute_dtype (the adapters cast to "
                          "the compute dtype in forward, their gradients and optimizer state "
                          "kept in lora_dtype: saves no copy of any adapter input) or "
                          "lora_dtype (peft's default: each adapter casts its input to "
                          "lora_dtype and keeps that copy for backward)"},
    )

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}; pass e.g. r=8.")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}; pass e.g. alpha=16.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}.")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            parts = tuple(s.strip() for s in self.target_modules.split(",") if s.strip())
            object.__setattr__(self, "target_modules", parts)
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty; pass 'all-linear' or module names.")
        # a short form ("bf16") is accepted and kept under its canonical name
        object.__setattr__(self, "dtype", dtype_name(self.dtype, what="LoRA dtype"))
        if self.compute not in LORA_COMPUTES:
            raise ValueError(f"LoRA compute must be one of {', '.join(LORA_COMPUTES)}, got "
                             f"{self.compute!r}; compute_dtype runs the adapters' matmuls in "
                             "the model's compute dtype, lora_dtype in the adapters' own.")

    @classmethod
    def coerce(cls, value: LoraOptions | Mapping[str, Any] | None) -> LoraOptions | None:
        """Accept ``None``, a :class:`LoraOptions` or a dict of its fields."""
        if value is None or isinstance(value, LoraOptions):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise TypeError(
                    f"unknown LoRA option(s) {unknown}; valid keys are {sorted(known)}."
                )
            kw = dict(value)
            if isinstance(kw.get("target_modules"), Sequence) and not isinstance(
                kw["target_modules"], str
            ):
                kw["target_modules"] = tuple(kw["target_modules"])
            return cls(**kw)
        raise TypeError(f"lora must be a dict, LoraOptions or None, got {type(value).__name__}.")


@dataclass(frozen=True)
class PrepareOptions:
    """How :func:`tightfit.prepare` stacks the memory pieces on a causal LM."""

    quant: QuantKind | None = field(
        default="nf4", metadata={"help": "4-bit base weights (bitsandbytes): nf4, fp4 or none"}
    )
    double_quant: bool = field(
        default=True,
        metadata={"help": "quantize the quantization constants too (about 0.5 -> 0.127 bits/param)"},
    )
    blocksize: int = field(default=64, metadata={"help": "4-bit quantization block size"})
    compute_dtype: ComputeDtypeName = field(
        default="auto",
        metadata={"help": "dtype of the matmuls: auto = bfloat16 on CUDA, float32 on the CPU"},
    )
    checkpoint: str | None = field(
        default="budget",
        metadata={
            "help": "gradient-checkpoint policy: budget, none, every, sqrt, uniform:K, selective"
        },
    )
    checkpoint_budget: int | None = field(
        default=None,
        metadata={
            "help": "activation bytes the 'budget' policy may use, e.g. 64MiB "
            "(default: halfway between the smallest plan's peak and no checkpointing)"
        },
    )
    loss_chunks: int | Literal["auto", "none"] | None = field(
        default="auto",
        metadata={"help": "tokens per chunk of the LM head + loss: auto, an integer, or none"},
    )
    # long context (docs/checkpoint.md, "Long context in prepare and tightfit train")
    offload: OffloadMode = field(
        default="auto",
        metadata={"help": "where activations wait for backward: auto (on the next tier only "
                          "when the checkpoint budget needs it), none, inputs (each "
                          "checkpointed segment's input), all (also stored layers' saved "
                          "tensors); the next tier is pinned host RAM on CUDA, a spill file "
                          "on the CPU"},
    )
    offload_host_budget: int | None = field(
        default=None,
        metadata={"help": "bytes offloaded activations may take on the next tier (default: "
                          "what it has free; leave room there for the optimizer's host pages)"},
    )
    offload_dir: str | None = field(
        default=None,
        metadata={"help": "folder of the CPU's activation spill files (default: the temp "
                          "folder)"},
    )
    mlp_tile: int | Literal["auto", "none"] | None = field(
        default="auto",
        metadata={"help": "tokens per tile of each layer's MLP: auto (tiled only when a long "
                          "sequence does not fit the budget otherwise, the tile chosen by "
                          "prediction), none, or an integer (always tiled)"},
    )
    resident_layers: int | Literal["all", "auto"] = field(
        default="auto",
        metadata={"help": "decoder layers whose 4-bit base weights stay on the device: auto "
                          "(tightfit train: as many as the planner fits before it reads the "
                          "data, all when they fit; prepare() alone: all), all, or a number "
                          "(the last ones; the others wait on the next tier, pinned host RAM "
                          "on CUDA or a spill file on the CPU, and stream in one layer ahead: "
                          "docs/checkpoint.md, Paged base weights)"},
    )

    def __post_init__(self) -> None:
        if self.quant not in (None, "nf4", "fp4"):
            raise ValueError(f"quant must be 'nf4', 'fp4' or None, got {self.quant!r}.")
        if self.compute_dtype != "auto":
            # a short form ("bf16") is accepted and kept under its canonical name
            canonical = dtype_name(self.compute_dtype, what="compute_dtype (or 'auto')")
            object.__setattr__(self, "compute_dtype", canonical)
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"blocksize must be a power of two in 32..4096, got {self.blocksize}.")
        if self.checkpoint_budget is not None and self.checkpoint_budget <= 0:
            raise ValueError(
                f"checkpoint_budget must be a positive number of bytes, got {self.checkpoint_budget}."
            )
        if self.loss_chunks == "none":
            # the spelling checkpoint="none" uses (and the command line's): no chunking
            object.__setattr__(self, "loss_chunks", None)
        if isinstance(self.loss_chunks, str) and self.loss_chunks != "auto":
            raise ValueError(f"loss_chunks must be 'auto', 'none' or a number of tokens, got "
                             f"{self.loss_chunks!r}.")
        if isinstance(self.loss_chunks, int) and self.loss_chunks < 1:
            raise ValueError(f"loss_chunks must be >= 1 tokens or 'auto', got {self.loss_chunks}.")
        self._check_long_context()

    def _check_long_context(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got "
                             f"{self.offload!r}.")
        if self.offload == "inputs" and self.checkpoint in (None, "none"):
            raise ValueError("offload='inputs' moves checkpointed segments' inputs, and "
                             "checkpoint='none' checkpoints nothing; pick a checkpoint policy "
                             "or offload='all' (stored layers' saved tensors).")
        if self.mlp_tile == "none":
            object.__setattr__(self, "mlp_tile", None)  # as loss_chunks spells "no tiles"
        tile = self.mlp_tile
        if tile is not None and tile != "auto" and (
                isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"mlp_tile must be 'auto', 'none' or a positive number of tokens, "
                             f"got {tile!r}.")
        budget = self.offload_host_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"offload_host_budget must be a number of bytes >= 0 or None, got "
                             f"{budget!r}.")
        check_resident_layers(self.resident_layers)
        if self.resident_layers not in ("all", "auto") and self.quant is None:
            raise ValueError("resident_layers pages the 4-bit base weights, and quant=None "
                             "keeps none; pass quant='nf4' or resident_layers='all'.")

    @classmethod
    def merged(cls, options: PrepareOptions | None, overrides: Mapping[str, Any]) -> PrepareOptions:
        """``options`` (default: ``PrepareOptions()``) with ``overrides`` applied by field name.

        Raises:
            TypeError: An override that is not a field.
            ValueError: An override that differs from what ``options`` says.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown prepare option(s) {unknown}; valid ones are "
                            f"{sorted(known)}.")
        if options is None:
            return cls(**overrides)
        merged = replace(options, **overrides)  # each value as the dataclass spells it
        clash = [k for k in overrides if getattr(merged, k) != getattr(options, k)]
        if clash:
            said = ", ".join(f"{k}={overrides[k]!r} (options has {getattr(options, k)!r})"
                             for k in clash)
            raise ValueError(f"prepare() got options= and {said}; pass one: change the "
                             f"PrepareOptions (dataclasses.replace) or drop options=.")
        return options

    def torch_compute_dtype(self, device: torch.device) -> torch.dtype:
        """The compute dtype as a torch dtype, ``auto`` resolved for ``device``."""
        if self.compute_dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return torch_dtype(self.compute_dtype)
