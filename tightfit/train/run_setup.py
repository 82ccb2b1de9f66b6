"""Setting up a ``tightfit train`` run: every check, then the model, data, optimizer and folder.

Everything that can be wrong with the input (model folder, data, sequence length, LoRA
targets, budgets, a resume folder from another configuration) is checked before the first
step and before anything in the output folder is written. :func:`setup` returns a
:class:`Run`, the state the steps (:func:`tightfit.train.loop.run_steps`) then advance.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit.measure.heap import fix_mmap_threshold
from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.optim.registry import optimizer_for, trainable_parameters
from tightfit.planner.host import host_limit
from tightfit.qlora.prepare import PrepareInfo, load_causal_lm, prepare
from tightfit.tiers import pinned
from tightfit.tiers.pinned import PinnedHost
from tightfit.train import builtin, preflight, resume, validate
from tightfit.train.data import TrainData, load_tokenizer, load_train_data, tokenizer_folder
from tightfit.train.job import TrainJob
from tightfit.train.memory import StepMemory, pressure_note
from tightfit.train.run_options import RESUME_FREE, RunConfig, TrainOptions

DEMO_PAGE_BYTES = 64 << 10
DEMO_DEVICE_BUDGET = 256 << 10


@dataclass
class Run:
    """What :func:`setup` built, and the state the training steps advance.

    Attributes:
        cfg: The run's options.
        job: This process's place in the run (one process, or one rank under torchrun).
        out: The output folder.
        data: The training (and eval) data, batched.
        model: The prepared model (a peft model when LoRA is on).
        runner: What forward/backward run through: ``model``, its DDP wrapper, or ``model``
            sharded in place by FSDP2.
        optimizer: The optimizer over the (possibly sharded) trainable parameters.
        info: What :func:`tightfit.prepare` did (``model.tightfit_info``).
        example: The global batch the plan was profiled on and the report is measured on.
        log: Where to print messages (silent on every rank but rank 0).
        progress: Whether to show a progress bar.
        start: The first step to run (the saved step when resuming).
        history: One record per step done so far (read back when resuming).
        last_saved: The folder of the newest saved resume state, if any.
        memory: Reads each step's memory figures.
        oom_retries: Steps retried after running out of memory in forward/backward.
        step_rng: The RNG state at the start of the step in progress (a retry starts there).
        rng_done: The RNG state after the last completed step (what a save of it holds).
        prev_stats: The optimizer's ``memory_stats()`` after the previous step.
        saving: A save is being written (an interrupt then keeps the previous one).
    """

    cfg: RunConfig
    job: TrainJob
    out: Path
    data: TrainData
    model: nn.Module
    runner: nn.Module
    optimizer: torch.optim.Optimizer
    info: PrepareInfo
    example: dict[str, torch.Tensor]
    log: Callable[[str], None]
    progress: bool
    start: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    last_saved: Path | None = None
    memory: StepMemory = field(init=False)
    trainable: list[torch.Tensor] = field(init=False)  # what gets gradients (and is clipped)
    oom_retries: int = 0
    step_rng: dict[str, Any] = field(default_factory=resume.rng_state)
    rng_done: dict[str, Any] = field(default_factory=resume.rng_state)
    prev_stats: dict[str, Any] = field(default_factory=dict)
    saving: bool = False

    def __post_init__(self) -> None:
        self.memory = StepMemory(self.device)
        # the optimizer exists, so the params are final (sharded where they are): list once
        self.trainable = trainable_parameters(self.model)

    @property
    def device(self) -> torch.device:
        return self.info.device


def setup(cfg: RunConfig, *, progress: bool, log: Callable[[str], None]) -> Run:
    """Check every input, build model, data and optimizer, then open the output folder.

    A fresh run creates the folder and writes ``run_config.json``; a resume loads the
    adapter, the optimizer and the RNG states from the newest saved state. Neither happens
    unless every check passed.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad input, before anything is written.
    """
    t = cfg.train
    validate.check_run(cfg)  # the lr, device, folders: before torchrun starts or anything loads
    job = TrainJob.start(t.fsdp, t.batch_size, t.device,  # torchrun: one rank of N
                         reshard_after_forward=t.zero3, fsdp_offload=t.fsdp_offload)
    if not job.is_main:
        log, progress = (lambda _msg: None), False
    out = _output_folder(t)
    saved = _check_output_folder(out, t)
    _set_threads(t)
    step_device = _step_device(job, t.device)
    if step_device.type == "cpu":
        # freed activations go back to the OS between steps: the RSS (what the preflight, the
        # pressure probe and a memory cgroup count) follows the live tensors
        fix_mmap_threshold()
    # the planner on the run's own options against the real limit, before any data is read
    pre = preflight.check_fits(cfg, step_device)
    cfg, t = pre.cfg, pre.cfg.train
    for note in pre.notes:
        log(f"note: {note}")
    data = _load_data(cfg, progress)
    try:
        if t.epochs is not None:  # the steps of --epochs, now that the data's size is known
            steps = math.ceil(t.epochs * data.train.steps_per_epoch())
            cfg = replace(cfg, train=replace(t, steps=steps))
            if saved is not None:
                _check_steps_left(out, cfg.train)
        return _build(cfg, job, out, saved, data, progress, log)
    except BaseException:
        data.close()
        raise


def _build(cfg: RunConfig, job: TrainJob, out: Path, saved: dict[str, Any] | None,
           data: TrainData, progress: bool, log: Callable[[str], None]) -> Run:
    """Model, optimizer and output folder over checked data (``setup``'s second half)."""
    t = cfg.train
    flat = {**cfg.flat(), "data.fingerprint": data.fingerprint,
            "data.eval_fingerprint": data.eval_fingerprint}
    if saved is not None:
        _check_same_config(out, saved, flat)
        _note_schedule_horizon(saved, flat, log)
    example = data.train.largest()  # the longest micro-batch: the planner plans for the worst
    # one pinned-host budget for the offloaded activations, the optimizer's host pages and the
    # staging buffers together: what `tightfit plan` checks (host_limit: the pinned fraction
    # of the RAM, within the memory cgroup's limit), counted as pinned (tiers.pinned)
    with pinned.sharing(PinnedHost(host_limit().budget)):
        runner = None
        if job.loads_shards(t.model):  # --fsdp: each rank reads its shards, never the whole model
            torch.manual_seed(t.seed)  # LoRA's first A, drawn as in one process
            model = job.load_sharded(t.model, cfg.prepare, cfg.lora, example,
                                     check=lambda meta: _check_model(meta, t, data))
            runner = model
        else:
            model = _load_model(cfg, data)
        if t.model is None:
            log(builtin.RANDOM_WEIGHTS_NOTE)
        log(data.describe())
        log(data.summary["preview"])
        log(data.epochs(t.steps))

        if runner is None:
            # under torchrun the rank's own device (cuda:LOCAL_RANK), which NCCL and DDP use
            model = prepare(model, options=cfg.prepare, lora=cfg.lora, example=example,
                            device=job.model_device(t.device))
            runner = job.wrap(model)  # DDP wrapper or FSDP2-sharded in place: the optimizer sees shards
        info = model.tightfit_info
        o = _optimizer_options(cfg, log)
        # the target (auto: where it can act) and a watch on the model's blocks: pages leave the
        # device before a long batch's activations pass the target, on every rank
        optimizer = optimizer_for(model, o)
    for note in info.notes:
        log(f"note: {note}")
    if info.plan is not None:
        log(str(info.plan))
    log(pressure_note(optimizer, o.target))

    run = Run(cfg, job, out, data, model, runner, optimizer, info, example, log, progress)
    _open_output_folder(run, flat, resuming=saved is not None)
    return run


def _output_folder(t: TrainOptions) -> Path:
    if t.resume is not None:
        return Path(t.resume)
    if t.out is not None:
        return Path(t.out)
    # a fresh folder per run, so running the demo twice just works
    return Path("tightfit-out") / time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())


def _check_output_folder(out: Path, t: TrainOptions) -> dict[str, Any] | None:
    """The saved run config when resuming (``None`` for a new run), the folder checked."""
    if t.resume is not None:
        saved = resume.read_config(out)
        latest = resume.latest_state(out)
        if latest is None:
            raise ValueError(f"{str(out)!r} has no complete saved state to resume from; start "
                             "a new run instead of --resume.")
        if t.epochs is None:  # with --epochs the steps are known once the data is read
            _check_steps_left(out, t)
        return saved
    if resume.latest_state(out) is not None:
        raise ValueError(f"{str(out)!r} already holds a run; pass --resume {out} to continue it "
                         "or choose another --out.")
    return None


def _check_steps_left(out: Path, t: TrainOptions) -> None:
    done = resume.state_step(resume.latest_state(out))  # verified once, when it is loaded
    if t.steps <= done:
        more = "--epochs E with more passes" if t.epochs is not None else f"--steps N with N > {done}"
        raise ValueError(f"the run in {str(out)!r} has done {done} steps; pass {more} to train "
                         "it further.")


def _check_same_config(out: Path, saved: dict[str, Any], flat: dict[str, Any]) -> None:
    diff = resume.config_mismatch(saved, flat, set(RESUME_FREE))
    if diff:
        shown = "; ".join(f"{k}: was {saved.get(k)!r}, now {flat.get(k)!r}" for k in diff)
        raise ValueError(f"--resume {str(out)!r} was written by another configuration ({shown}); "
                         "resume with the same options or start a new --out.")


def _note_schedule_horizon(saved: dict[str, Any], flat: dict[str, Any],
                           log: Callable[[str], None]) -> None:
    if flat["train.lr_schedule"] != "constant" and saved.get("train.steps") != flat["train.steps"]:
        log(f"note: --lr-schedule {flat['train.lr_schedule']} decays over --steps: from here on "
            f"over {flat['train.steps']} steps (the steps done used {saved.get('train.steps')})")


def _set_threads(t: TrainOptions) -> None:
    builtin_on_cpu = t.model is None and _device_type(t.device) == "cpu"
    threads = t.threads if t.threads is not None else (1 if builtin_on_cpu else None)
    if threads is not None:
        # The built-in model's matrices are too small to gain from a second thread, and on
        # a busy machine an OpenMP team of two stalls badly waiting for its second core.
        torch.set_num_threads(threads)


def _step_device(job: TrainJob, device: str | None) -> torch.device:
    """Where this process's step will run (``--device``, the rank's device, or the default)."""
    chosen = job.model_device(device)
    if chosen is None:
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(chosen)


def _device_type(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _load_data(cfg: RunConfig, progress: bool) -> TrainData:
    """The tokenizer and the checked, tokenized data (the model folder checked first)."""
    t = cfg.train  # the model folder and the data paths were checked (validate.check_run)
    return load_train_data(cfg.data, load_tokenizer(t.model, t.tokenizer), seq_len=t.seq_len,
                           batch_size=t.batch_size, grad_accum=t.grad_accum, seed=t.seed,
                           progress=progress)


def _load_model(cfg: RunConfig, data: TrainData) -> nn.Module:
    """The unprepared model, checked against the data (positions, vocabulary)."""
    t = cfg.train
    torch.manual_seed(t.seed)  # the built-in model's random weights come from the seed
    model = builtin.builtin_model() if t.model is None else load_causal_lm(t.model)
    _check_model(model, t, data)
    return model


def _check_model(model: nn.Module, t: TrainOptions, data: TrainData) -> None:
    """The model against the data (positions, vocabulary); the KV cache off."""
    if getattr(model, "config", None) is not None:
        # Training: a KV cache is memory for nothing, and it turns off transformers' packed
        # sequence masks (--batching pack).
        model.config.use_cache = False
    limit = builtin.max_positions(model)
    if limit is not None and t.seq_len > limit:
        raise ValueError(
            f"--seq-len {t.seq_len} is longer than the model allows ({limit} positions); "
            f"pass --seq-len {limit} or less.")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    top = max(b.examples.max_id() for b in (data.train, data.eval) if b is not None)
    if vocab is not None and top >= vocab:
        folder = tokenizer_folder(t.model, t.tokenizer)
        used = "--tokenizer bytes" if folder is None else f"the tokenizer of {folder!r}"
        raise ValueError(
            f"{used} gives id {top} but the model's vocabulary has {vocab} entries, so it is "
            "not this model's tokenizer; pass the model's own with --tokenizer DIR.")


def _optimizer_options(cfg: RunConfig, log: Callable[[str], None]) -> OptimizerOptions:
    o = cfg.optimizer
    if cfg.train.model is None and o.page_bytes is None and o.device_budget is None:
        # The built-in demo's state is ~0.6 MiB: small pages and a budget of part of it make
        # the paging (and its report rows and timeline) real. Any paging flag turns this off.
        o = replace(o, page_bytes=DEMO_PAGE_BYTES, device_budget=DEMO_DEVICE_BUDGET)
        log(f"note: built-in demo pages its optimizer state: --page-bytes {DEMO_PAGE_BYTES} "
            f"--device-budget {DEMO_DEVICE_BUDGET} (the rest spills to disk)")
    return o


def _open_output_folder(run: Run, flat: dict[str, Any], *, resuming: bool) -> None:
    """All checks passed: from here on the output folder is written (or read to resume)."""
    if resuming:
        restored = run.job.load_state(resume.latest_state(run.out), run.model, run.optimizer)
        run.start, run.history = restored.step, restored.history
        run.rng_done = resume.rng_state()  # as the saved state left it
        run.log(f"resumed from {restored.folder} at step {run.start}")
    elif run.job.is_main:
        run.out.mkdir(parents=True, exist_ok=True)
        resume.write_config(run.out, flat)
    if run.job.is_main:  # after a load, which may still refuse: a refused resume removes nothing
        note = resume.clean_leftovers(run.out, run.optimizer)  # temps of killed runs
        if note is not None:
            run.log(note)
    run.job.barrier()
    run.last_saved = resume.latest_state(run.out)
