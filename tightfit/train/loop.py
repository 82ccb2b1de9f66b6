"""The training loop behind ``tightfit train``: prepare, train, checkpoint, report.

Everything that can be wrong with the input (model folder, data, sequence length, LoRA
targets, budgets, a resume folder from another configuration) is checked before the first
step and before anything in the output folder is written.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tightfit.measure.tracker import MemoryTracker
from tightfit.optim.registry import OptimizerOptions, optimizer_for
from tightfit.qlora.options import LoraOptions, PrepareOptions
from tightfit.qlora.prepare import load_causal_lm, prepare
from tightfit.report.report import MemoryReport, measure_report
from tightfit.train import data as data_mod
from tightfit.train import model as builtin
from tightfit.train import resume as ck
from tightfit.train.job import TrainJob
from tightfit.train.plots import plot_loss, plot_ranks, plot_timeline


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
    save_every: int = field(default=50, metadata={"help": "write a checkpoint every N steps"})
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


@dataclass
class TrainResult:
    """What a run produced."""

    out: Path
    history: list[dict[str, Any]]
    report: MemoryReport
    files: dict[str, Path]
    notes: list[str]


DEMO_PAGE_BYTES = 64 << 10
DEMO_DEVICE_BUDGET = 256 << 10


def _device_type(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


# Options that may change between a run and its resume without changing the trajectory.
_FREE_KEYS = {"train.steps", "train.out", "train.resume", "train.save_every",
              "train.track_every", "train.threads", "optimizer.spill_dir", "train.fsdp",
              "train.zero3"}


def _flat_config(cfg: RunConfig, fingerprint: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for group, value in asdict(cfg).items():
        for k, v in value.items():
            flat[f"{group}.{k}"] = list(v) if isinstance(v, tuple) else v
    flat["data.fingerprint"] = fingerprint
    return flat


def _lr_at(step: int, lr: float, warmup: int) -> float:
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def _opt_stats(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    stats = getattr(optimizer, "memory_stats", None)
    if callable(stats):
        return dict(stats())
    total = sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"device_bytes": total, "device_budget": None, "bytes_paged_in": 0,
            "bytes_paged_out": 0}


def _load_inputs(cfg: RunConfig) -> tuple[Any, data_mod.TokenData, Any]:
    """Model (unprepared), data and tokenizer, every check done."""
    t = cfg.train
    if t.model is None:
        tokenizer: Any = data_mod.ByteTokenizer()
    else:
        folder = Path(t.model)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"model folder {t.model!r} does not exist; pass a local Hugging Face model "
                "folder or omit --model for the built-in model.")
        tokenizer = (data_mod.HFTokenizer(folder) if data_mod.has_hf_tokenizer(folder)
                     else data_mod.ByteTokenizer())
    tokens = data_mod.TokenData.from_text(data_mod.read_corpus(t.data), tokenizer)
    tokens.check_fits(t.seq_len)
    torch.manual_seed(t.seed)  # the built-in model's random weights come from the seed
    model = builtin.builtin_model() if t.model is None else load_causal_lm(t.model)
    limit = builtin.max_positions(model)
    if limit is not None and t.seq_len > limit:
        raise ValueError(
            f"--seq-len {t.seq_len} is longer than the model allows ({limit} positions); "
            f"pass --seq-len {limit} or less.")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(tokens.tokens.max()) >= vocab:
        raise ValueError(
            f"the tokenizer produces id {int(tokens.tokens.max())} but the model's vocabulary "
            f"has {vocab} entries; use the model folder's own tokenizer.")
    return model, tokens, tokenizer


def train(
    cfg: RunConfig,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Run ``tightfit train``.

    Args:
        cfg: The run's options.
        progress: Show a progress bar (loss, tokens/s, device-tier occupancy).
        log: Where to print messages.

    Returns:
        The output folder, the per-step history, the memory report and the files written.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad input, before training starts.
    """
    t = cfg.train
    job = TrainJob.start(t.fsdp, t.batch_size, t.device,  # torchrun: one rank of N
                         reshard_after_forward=t.zero3)
    if not job.is_main:
        log, progress = (lambda _msg: None), False
    if t.resume is not None:
        out = Path(t.resume)
    elif t.out is not None:
        out = Path(t.out)
    else:  # a fresh folder per run, so running the demo twice just works
        out = Path("tightfit-out") / time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    saved = None
    if t.resume is not None:
        saved = ck.read_config(out)
        if ck.latest_checkpoint(out) is None:
            raise ValueError(f"{str(out)!r} has no complete checkpoint to resume from; start a "
                             "new run instead of --resume.")
    elif ck.latest_checkpoint(out) is not None:
        raise ValueError(f"{str(out)!r} already holds a run; pass --resume {out} to continue it "
                         "or choose another --out.")

    builtin_on_cpu = t.model is None and _device_type(t.device) == "cpu"
    threads = t.threads if t.threads is not None else (1 if builtin_on_cpu else None)
    if threads is not None:
        # The built-in model's matrices are too small to gain from a second thread, and on
        # a busy machine an OpenMP team of two stalls badly waiting for its second core.
        torch.set_num_threads(threads)
    model, tokens, _ = _load_inputs(cfg)
    flat = _flat_config(cfg, tokens.fingerprint)
    if saved is not None:
        diff = ck.config_mismatch(saved, flat, _FREE_KEYS)
        if diff:
            shown = "; ".join(f"{k}: was {saved.get(k)!r}, now {flat.get(k)!r}" for k in diff)
            raise ValueError(f"--resume {str(out)!r} was written by another configuration ({shown}); "
                             "resume with the same options or start a new --out.")
    if t.model is None:
        log(builtin.RANDOM_WEIGHTS_NOTE)

    example = tokens.batch(0, t.batch_size, t.seq_len, t.seed)
    model = prepare(model, options=cfg.prepare, lora=cfg.lora, example=example, device=t.device)
    info = model.tightfit_info
    device = info.device
    runner = job.wrap(model)  # DDP wrapper or FSDP2-sharded in place; the optimizer sees shards
    o = cfg.optimizer
    if t.model is None and o.page_bytes is None and o.device_budget is None:
        # The built-in demo's state is ~0.6 MiB: small pages and a budget of part of it make
        # the paging (and its report rows and timeline) real. Any paging flag turns this off.
        o = replace(o, page_bytes=DEMO_PAGE_BYTES, device_budget=DEMO_DEVICE_BUDGET)
        log(f"note: built-in demo pages its optimizer state: --page-bytes {DEMO_PAGE_BYTES} "
            f"--device-budget {DEMO_DEVICE_BUDGET} (the rest spills to disk)")
    optimizer = optimizer_for(model, o.kind, lr=o.lr, weight_decay=o.weight_decay,
                              page_bytes=o.page_bytes, device_budget=o.device_budget,
                              host_budget=o.host_budget, spill_dir=o.spill_dir)
    for note in info.notes:
        log(f"note: {note}")
    if info.plan is not None:
        log(str(info.plan))

    # -- all checks passed: from here on the output folder is written ---------------------
    start, history = 0, []
    if saved is not None:
        restored = job.load_checkpoint(ck.latest_checkpoint(out), model, optimizer)
        start, history = restored.step, restored.history
        log(f"resumed from {restored.folder} at step {start}")
    elif job.is_main:
        out.mkdir(parents=True, exist_ok=True)
        ck.write_config(out, flat)
    job.barrier()

    trainable = [p for p in model.parameters() if p.requires_grad]
    bar = _progress(start, t.steps, progress)
    last_ckpt = ck.latest_checkpoint(out)
    prev = _opt_stats(optimizer)
    model.train()
    for step in range(start, t.steps):
        batch = example_on(job.rows(tokens.batch(step, t.batch_size, t.seq_len, t.seed)), device)
        for g in optimizer.param_groups:
            g["lr"] = _lr_at(step, o.lr, t.warmup_steps)
        tic = time.perf_counter()
        tracked = t.track_every > 0 and step % t.track_every == 0
        tracker = MemoryTracker(device) if tracked else None
        with tracker if tracker is not None else contextlib.nullcontext():
            loss = runner(**batch).loss
            loss.backward()
        if t.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - tic
        stats = _opt_stats(optimizer)
        rec = {
            "step": step + 1,
            "loss": job.mean(float(loss.item())),
            "lr": optimizer.param_groups[0]["lr"],
            "seconds": dt,
            "tokens_per_s": t.batch_size * t.seq_len / dt,
            "time": time.monotonic(),  # the clock paging events use
            "device_bytes": int(stats.get("device_bytes", 0)),
            "device_budget": stats.get("device_budget"),
            "activation_peak": tracker.peak_bytes if tracker is not None else None,
            "paged_in": int(stats.get("bytes_paged_in", 0)) - int(prev.get("bytes_paged_in", 0)),
            "paged_out": int(stats.get("bytes_paged_out", 0))
            - int(prev.get("bytes_paged_out", 0)),
        }
        rec.update(job.rank_figures(rec))
        prev = stats
        history.append(rec)
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step + 1}; lower --lr.")
        _update_bar(bar, rec)
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
            last_ckpt = job.save_checkpoint(out, step + 1, model, optimizer, history)
    if bar is not None:
        bar.close()

    report = measure_report(model, example_on(job.rows(example), device), optimizer=optimizer,
                            base_numel=info.base_numel)
    report.meta.update(job.report_meta(optimizer))
    report.meta.update({
        "steps": t.steps,
        "tokens_per_s_median": _median([h["tokens_per_s"] for h in history]),
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
    })
    files = report.save(out) if job.is_main else {}
    events = _paging_events(optimizer)
    if job.is_main:
        files["loss_png"] = plot_loss(history, out / "loss_curve.png")
        files["timeline_png"] = plot_timeline(history, out / "memory_timeline.png", events)
        if job.distributed:

            files["ranks_png"] = plot_ranks(history, out / "memory_ranks.png")
        if last_ckpt is not None:
            files["adapter"] = ck.publish_adapter(out, last_ckpt)
            files["checkpoint"] = last_ckpt
    close = getattr(optimizer, "close", None)
    if callable(close):
        close()
    job.close()
    return TrainResult(out, history, report, files, list(info.notes))


def example_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _paging_events(optimizer: torch.optim.Optimizer) -> list[Any]:
    fn = getattr(optimizer, "paging_events", None)
    return list(fn()) if callable(fn) else []


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def _progress(start: int, total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _update_bar(bar: Any, rec: dict[str, Any]) -> None:
    if bar is None:
        return
    budget = rec.get("device_budget")
    dev = rec["device_bytes"]
    occ = f"{dev / budget:.0%}" if budget else f"{dev / 2**20:.1f}MiB"
    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", dev=occ,
                    refresh=False)
    bar.update(1)
