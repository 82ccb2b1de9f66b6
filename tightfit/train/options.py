"""The options of ``tightfit train``: the run itself, and every piece's options grouped.

The command line (:mod:`tightfit.train.cli`) is generated from these dataclasses, so flags,
defaults and help never drift from the Python API. Each dataclass checks its own values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tightfit.optim.registry import OptimizerOptions
from tightfit.qlora.options import LoraOptions, PrepareOptions


@dataclass(frozen=True)
class TrainOptions:
    """The run itself: model, data, output folder, sizes, schedule."""

    model: str | None = field(
        default=None, metadata={"help": "local HF causal-LM folder (default: the built-in model)"}
    )
    data: str | None = field(
        default=None,
        metadata={"help": "text file or folder (default: the Python stdlib's source files)"},
    )
    out: str | None = field(
        default=None,
        metadata={"help": "output folder (default: a new tightfit-out/run-<UTC time> folder)"},
    )
    steps: int = field(default=120, metadata={"help": "training steps"})
    batch_size: int = field(default=8, metadata={"help": "sequences per step"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    warmup_steps: int = field(default=10, metadata={"help": "linear learning-rate warmup steps"})
    grad_clip: float | None = field(
        default=1.0, metadata={"help": "clip the gradient norm to this (none: no clipping)"}
    )
    seed: int = field(default=0, metadata={"help": "seed for weights, data order and dropout"})
    save_every: int = field(default=50, metadata={"help": "save the resume state every N steps"})
    track_every: int = field(
        default=10, metadata={"help": "measure the activation peak every N steps (0: never)"}
    )
    device: str | None = field(
        default=None, metadata={"help": "cpu or cuda (default: cuda when available)"}
    )
    threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (default: torch's choice)"}
    )
    resume: str | None = field(
        default=None, metadata={"help": "continue the run in this output folder, bit-exactly"}
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "under torchrun: shard LoRA params, grads and optimizer state with "
                          "FSDP2 (default: DDP replicas); see docs/distributed.md"},
    )
    zero3: bool = field(
        default=False,
        metadata={"help": "with --fsdp: free gathered params after each block's forward (ZeRO-3; "
                          "the checkpoint recompute gathers them again). Default ZeRO-2 keeps "
                          "them until backward: measured ~1.3x faster for QLoRA's small adapters"},
    )

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2 tokens, got {self.seq_len}.")
        if self.zero3 and not self.fsdp:
            raise ValueError("--zero3 only applies to FSDP2 sharding; add --fsdp (under torchrun).")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"--grad-clip must be > 0 or none, got {self.grad_clip}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}.")
        if self.warmup_steps < 0 or self.track_every < 0:
            raise ValueError("--warmup-steps and --track-every must be >= 0.")


@dataclass(frozen=True)
class RunConfig:
    """Every option of a training run, grouped by the piece it configures."""

    train: TrainOptions = field(default_factory=TrainOptions)
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
