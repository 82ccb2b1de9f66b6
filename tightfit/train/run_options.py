"""The options of ``tightfit train``: the run itself, its data, and every piece's options grouped.

The command line (:mod:`tightfit.train.train_command`) is generated from these dataclasses, so flags,
defaults and help never drift from the Python API. Each dataclass checks its own values.

The defaults of a :class:`RunConfig` are the QLoRA recipe (Dettmers et al. 2023 and its
reference ``qlora.py``): learning rate 2e-4 with a constant schedule after warmup, LoRA r=16,
alpha=16, gradient norm clipped at 0.3; LoRA dropout 0, where the paper has 0.05-0.1
(:class:`~tightfit.qlora.prepare_options.LoraOptions` says why). The built-in demo uses them
too (its loss still falls from ln 256 ≈ 5.55 to about 4.7 in 120 steps).
"""

from __future__ import annotations

import math
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any, Literal

from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions

LrSchedule = Literal["constant", "linear", "cosine"]
DataFormat = Literal["auto", "raw", "text", "prompt-completion", "alpaca", "chat"]
Batching = Literal["bucket", "pack"]
TooLong = Literal["truncate", "refuse"]

# The column names each record format reads; --fields maps them to other names.
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "alpaca": ("instruction", "input", "output"),  # input optional (records.OPTIONAL)
    "chat": ("messages",),
}
_FIELD_NAMES = sorted({f for names in FORMAT_FIELDS.values() for f in names})

# Options a resumed run may change: they do not change the trajectory (the loss, adapter and
# optimizer state of every step). --steps changes a decaying schedule's horizon; setup says so.
RESUME_FREE = frozenset({
    "train.steps", "train.epochs", "train.out", "train.resume", "train.save_every", "train.track_every",
    "train.eval_every", "train.threads", "train.fsdp", "train.zero3", "train.fsdp_offload",
    "optimizer.spill_dir",
    "optimizer.target",  # paging is exact: where the state waits never changes a value
    "prepare.resident_layers",  # nor where the frozen base waits
})
# Options of one launch, not of the run: a resume does not inherit them (give --fsdp again
# under torchrun; a plain process resumes an FSDP2 run without it).
LAUNCH_KEYS = frozenset({"train.fsdp", "train.zero3", "train.fsdp_offload"})

# How an option's key becomes its command-line flag: a prefix per group, and renamed fields.
FLAG_PREFIX = {"lora": "lora_"}
FLAG_RENAMES = {"data.path": "data", "optimizer.kind": "optimizer"}


def flag_dest(key: str) -> str:
    """The argparse destination of ``"group.option"`` (``"lora.r"`` → ``"lora_r"``)."""
    group, _, name = key.partition(".")
    return FLAG_RENAMES.get(key, FLAG_PREFIX.get(group, "") + name)


def flag_name(key: str) -> str:
    """The command-line flag of ``"group.option"`` (``"lora.r"`` → ``"--lora-r"``)."""
    return "--" + flag_dest(key).replace("_", "-")


# Keys of run_config.json that are measured, not options.
DERIVED_KEYS = frozenset({"data.fingerprint", "data.eval_fingerprint"})


@dataclass(frozen=True)
class TrainOptions:
    """The run itself: model, output folder, sizes, schedule."""

    model: str | None = field(
        default=None, metadata={"help": "local HF causal-LM folder (default: the built-in model)"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "tokenizer folder, or bytes for UTF-8 bytes as ids 0-255 (default: the "
                          "model folder's own; bytes for the built-in model)"},
    )
    out: str | None = field(
        default=None,
        metadata={"help": "output folder (default: a new tightfit-out/run-<UTC time> folder)"},
    )
    steps: int = field(default=120, metadata={"help": "training steps (optimizer updates)"})
    epochs: float | None = field(
        default=None,
        metadata={"help": "passes over the training data to train for, instead of --steps "
                          "(rounded up to whole steps; the log says how many)"},
    )
    batch_size: int = field(
        default=8, metadata={"help": "sequences per forward pass (under torchrun: all ranks')"}
    )
    grad_accum: int = field(
        default=1,
        metadata={"help": "forward passes per step, their gradients summed: the same update as "
                          "one batch N times larger"},
    )
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence at most"})
    lr_schedule: LrSchedule = field(
        default="constant",
        metadata={"help": "learning rate after warmup: constant (QLoRA's), or a linear or "
                          "cosine decay to 0 at --steps"},
    )
    warmup_steps: int = field(default=10, metadata={"help": "linear learning-rate warmup steps"})
    grad_clip: float | None = field(
        default=0.3,
        metadata={"help": "clip the gradient norm to this, QLoRA's 0.3 (none: no clipping)"},
    )
    seed: int = field(default=0, metadata={"help": "seed for weights, data order and dropout"})
    save_every: int = field(default=50, metadata={"help": "save the resume state every N steps"})
    eval_every: int = field(
        default=50,
        metadata={"help": "eval loss every N steps when there is eval data, and at the end "
                          "(0: at the end only)"},
    )
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
        default=None,
        metadata={"help": "continue the run in this output folder, bit-exactly, with its saved "
                          "options (only --steps and options that do not change the math may "
                          "be given)"},
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "under torchrun: shard the 4-bit base, LoRA params, grads and "
                          "optimizer state with FSDP2, loading --model shard by shard "
                          "(default: DDP replicas); see docs/distributed.md"},
    )
    zero3: bool = field(
        default=False,
        metadata={"help": "with --fsdp: free gathered params after each block's forward (ZeRO-3; "
                          "the checkpoint recompute gathers them again). A block with a frozen "
                          "base (QLoRA) is always ZeRO-3: its base is sharded; without one the "
                          "default ZeRO-2 keeps them until backward"},
    )

    fsdp_offload: bool = field(
        default=False,
        metadata={"help": "with --fsdp: keep every rank's shards (the 4-bit base, LoRA, grads) "
                          "and the optimizer step on the host, FSDP2's CPUOffloadPolicy: the "
                          "GPU holds only the blocks gathered in flight, the root and the "
                          "activations (what tightfit plan --gpus N adds when the shards alone "
                          "leave too little room)"},
    )

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2 tokens, got {self.seq_len}.")
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"--epochs must be a number of passes > 0, got {self.epochs}; "
                             "e.g. --epochs 3.")
        if self.zero3 and not self.fsdp:
            raise ValueError("--zero3 only applies to FSDP2 sharding; add --fsdp (under torchrun).")
        if self.fsdp_offload and not self.fsdp:
            raise ValueError("--fsdp-offload keeps FSDP2's shards on the host; add --fsdp "
                             "(under torchrun), or drop --fsdp-offload.")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"--grad-clip must be > 0 or none, got {self.grad_clip}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}.")
        if min(self.warmup_steps, self.track_every, self.eval_every) < 0:
            raise ValueError("--warmup-steps, --track-every and --eval-every must be >= 0.")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-schedule must be constant, linear or cosine, got "
                             f"{self.lr_schedule!r}.")
        if self.resume is not None and self.out is not None and self.out != self.resume:
            raise ValueError(f"--resume {self.resume} continues the run in its own folder; drop "
                             f"--out {self.out} (to branch a run, copy its folder and resume the copy).")


@dataclass(frozen=True)
class DataOptions:
    """What to train on and how examples become batches (docs/train.md, "Data")."""

    path: str | None = field(
        default=None,
        metadata={"help": "text file or folder; JSON/JSONL/Parquet/CSV file or folder; a "
                          "datasets save_to_disk folder (default: the Python stdlib's source)"},
    )
    format: DataFormat = field(
        default="auto",
        metadata={"help": "raw (plain text, cut into --seq-len blocks), text, prompt-completion, "
                          "alpaca (instruction/input/output) or chat records (auto: from the "
                          "file type and the columns)"},
    )
    fields: str | None = field(
        default=None,
        metadata={"help": "other column names, e.g. prompt=question,completion=answer "
                          f"(names: {', '.join(_FIELD_NAMES)})"},
    )
    completion_only: bool = field(
        default=True,
        metadata={"help": "loss on completions only (prompt-completion; alpaca's output) and on "
                          "assistant turns only (chat); --no-completion-only trains on every "
                          "token"},
    )
    batching: Batching = field(
        default="bucket",
        metadata={"help": "bucket: batches of similar lengths, padded; pack: examples packed "
                          "into --seq-len rows with their own positions, no attention across"},
    )
    too_long: TooLong = field(
        default="truncate",
        metadata={"help": "a record longer than --seq-len: truncate it (counted and printed) "
                          "or refuse the data"},
    )
    max_text_bytes: int | None = field(
        default=None,
        metadata={"help": "read only the first N bytes of plain text (printed; default: all of "
                          "it, or 1MiB of the stdlib for the demo corpus)"},
    )
    eval_data: str | None = field(
        default=None, metadata={"help": "held-out data in the same format, for the eval loss"}
    )
    eval_fraction: float = field(
        default=0.0,
        metadata={"help": "hold out this fraction of the examples for the eval loss instead"},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.eval_fraction and self.eval_data is not None:
            raise ValueError("pass --eval-data or --eval-fraction, not both.")
        if self.max_text_bytes is not None and self.max_text_bytes < 1:
            raise ValueError(f"--max-text-bytes must be >= 1 byte, got {self.max_text_bytes}.")
        self.field_map()  # checks the --fields syntax

    def field_map(self) -> dict[str, str]:
        """The column each field name reads (``{"prompt": "question", ...}``; identity default).

        Raises:
            ValueError: ``fields`` is not ``name=column,...`` over the known field names.
        """
        mapping = {name: name for name in _FIELD_NAMES}
        for part in (self.fields or "").split(","):
            if not part.strip():
                continue
            name, eq, column = (s.strip() for s in part.partition("="))
            if not eq or not column or name not in mapping:
                raise ValueError(f"--fields {self.fields!r}: {part.strip()!r} is not NAME=COLUMN "
                                 f"with NAME one of {', '.join(_FIELD_NAMES)}; e.g. "
                                 "--fields prompt=question,completion=answer")
            mapping[name] = column
        return mapping


@dataclass(frozen=True)
class RunConfig:
    """Every option of a training run, grouped by the piece it configures."""

    train: TrainOptions = field(default_factory=TrainOptions)
    data: DataOptions = field(default_factory=DataOptions)
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)

    def flat(self) -> dict[str, Any]:
        """``{"group.option": value}`` as ``run_config.json`` holds it (tuples as lists)."""
        flat: dict[str, Any] = {}
        for group, value in asdict(self).items():
            for k, v in value.items():
                if k in _GROUP_FIELDS[group]:  # the command line's options only
                    flat[f"{group}.{k}"] = list(v) if isinstance(v, tuple) else v
        return flat

    def with_flat(self, changes: dict[str, Any]) -> RunConfig:
        """This config with ``{"group.option": value}`` changes, every value checked again.

        Raises:
            ValueError: a key that is no option of a run.
        """
        groups: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key in DERIVED_KEYS:
                continue
            group, _, name = key.partition(".")
            if group not in _GROUP_FIELDS or name not in _GROUP_FIELDS[group]:
                raise ValueError(f"{key!r} is not an option of tightfit train (written by "
                                 "another version?)")
            groups.setdefault(group, {})[name] = tuple(value) if isinstance(value, list) else value
        return replace(self, **{g: replace(getattr(self, g), **kw) for g, kw in groups.items()})


def cli_fields(options: type) -> list[Field[Any]]:
    """The fields of an options dataclass that are flags of ``tightfit train`` (all but those
    with ``metadata["cli"] = False``, which are for the Python API only)."""
    return [f for f in fields(options) if f.metadata.get("cli", True)]


_GROUP_FIELDS: dict[str, set[str]] = {
    f.name: {sub.name for sub in cli_fields(f.default_factory)}  # type: ignore[arg-type]
    for f in fields(RunConfig)
}
