"""Before any data is read: does this run's step fit the memory it will really run in?

``tightfit train --seq-len N`` with no other flag must either train at ``N`` or say, before
the data is tokenized and the model loaded, that ``N`` does not fit and what does. The check
is the planner's (:func:`tightfit.planner.run_fit.run_fit`), on the run's own options, against
the real limit:

* on CUDA, the device's memory, less a CUDA context's overhead (the planner's default);
* on the CPU, the memory cgroup's limit (else the machine's RAM), less what this process
  already holds (Python, torch, transformers: measured now, before the model exists) and the
  margin :func:`tightfit.prepare`'s long-step plan keeps free
  (:func:`tightfit.checkpoint.long_step.step_margin`), so that a step passed here is one
  prepare accepts.

What the options leave to the planner stays the planner's: ``--checkpoint budget`` gets the
room left, ``--loss-chunks auto`` / ``--mlp-tile auto`` the long-context rules, and
``--offload auto`` may put checkpointed inputs on the next tier, and ``--resident-layers
auto`` (the default) becomes the planner's number of layers whose 4-bit weights stay on the
device (``all`` when they fit; said when fewer): what ``tightfit plan --max-seq`` would use.
The chosen number is what the run's saved options hold, so a resume keeps it. A step that does not fit even so is refused with the longest sequence that does.

The analytic model is checked against measured steps in ``benchmarks/results/plan_accuracy*.md``;
the check refuses only what the model predicts does not fit at all (no safety margin), so a run
the prediction errs on by a few percent is not refused but may still run out of memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tightfit.checkpoint.long_step import step_margin
from tightfit.measure.cgroup import limiting_cgroup
from tightfit.measure.sizes import format_bytes
from tightfit.planner.host import HostLimit, host_limit
from tightfit.planner.presets import load_shape
from tightfit.planner.run_fit import RunFit, run_fit
from tightfit.planner.shapes import KNOWN_WEIGHTS
from tightfit.planner.train_setup import PLANNED_OPTIMIZERS, TrainSetup
from tightfit.pressure.room import machine_room
from tightfit.tiers.regions import tier_capacity
from tightfit.train.run_options import RunConfig

CUDA_OVERHEAD = 1 << 30  # the planner's default for a CUDA context and workspaces


@dataclass(frozen=True)
class Preflight:
    """What :func:`check_fits` found and decided.

    Attributes:
        cfg: The run's options, with the planner's resident layers where it chose them.
        fit: The planner's answer (``None``: the run's options are not modelled).
        notes: What to tell the user (one line each).
    """

    cfg: RunConfig
    fit: RunFit | None
    notes: tuple[str, ...]


def _not_modelled(cfg: RunConfig) -> str | None:
    """Why the planner cannot check this run (``None``: it can)."""
    t, p = cfg.train, cfg.prepare
    if t.model is None:
        return "the built-in model"  # tiny: it fits anywhere
    if not (Path(t.model) / "config.json").is_file():
        return "a model folder without config.json"
    if t.fsdp or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # per-rank plans: tightfit plan --gpus
        return "a run on several processes (or --fsdp)"
    if cfg.optimizer.kind not in PLANNED_OPTIMIZERS:
        return f"--optimizer {cfg.optimizer.kind}"
    if (p.checkpoint or "none").startswith("selective"):
        return "--checkpoint selective"
    targets = cfg.lora.target_modules
    if targets != "all-linear":
        names = (targets,) if isinstance(targets, str) else tuple(targets)
        if any(n not in KNOWN_WEIGHTS for n in names):
            return f"--lora-target-modules {','.join(names)}"
    return None


def planned_setup(cfg: RunConfig, device: torch.device) -> tuple[TrainSetup, dict[str, bool]]:
    """The :class:`TrainSetup` of ``cfg`` on ``device``, and which pieces the planner sizes
    (``chunked``, ``tiled``, ``paged_weights``: the options left at ``auto``/``all``)."""
    t, p, lora = cfg.train, cfg.prepare, cfg.lora
    compute = p.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if device.type == "cuda" else "float32"
    checkpoint = p.checkpoint or "none"
    offload = p.offload if p.offload != "auto" else ("none" if checkpoint == "none" else "inputs")
    targets = lora.target_modules
    if targets != "all-linear":
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
    setup = TrainSetup(
        seq_len=t.seq_len, batch_size=t.batch_size, compute_dtype=compute,
        quant="none" if p.quant is None else "nf4",  # FP4 stores what NF4 stores
        double_quant=bool(p.double_quant) and p.quant is not None, blocksize=p.blocksize,
        lora_r=lora.r, lora_target_modules=targets, lora_dropout=lora.dropout,
        lora_dtype=lora.dtype, lora_compute=lora.compute, checkpoint=checkpoint,
        checkpoint_budget=1 if checkpoint == "budget" else None,
        optimizer=cfg.optimizer.kind, optimizer_device_budget=cfg.optimizer.device_budget,
        loss_chunk_tokens=p.loss_chunks if isinstance(p.loss_chunks, int) else None,
        offload=offload, mlp_tile=p.mlp_tile if isinstance(p.mlp_tile, int) else None,
        resident_layers="all" if p.resident_layers == "auto" else p.resident_layers)
    sized = {"chunked": p.loss_chunks == "auto", "tiled": p.mlp_tile == "auto",
             "paged_weights": p.resident_layers == "auto" and p.quant is not None}
    return setup, sized


def real_limit(device: torch.device, spill_dir: str | None) -> tuple[int, str, int, HostLimit]:
    """``(limit bytes, what it is, overhead bytes, next tier)`` of the memory a step runs in."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{device}'s memory", CUDA_OVERHEAD, host_limit()
    # reading the data imports datasets (and pyarrow), 80 MiB here: held before the data is read
    import datasets  # noqa: F401
    import psutil

    cg = limiting_cgroup()
    if cg is not None and cg.limit is not None:
        limit, source = cg.limit, "the memory cgroup's limit"
    else:
        limit, source = int(psutil.virtual_memory().total), "this machine's RAM"
    # what is not the step's: the process itself (interpreter, torch, transformers) and, without
    # a cgroup, the other processes (the room is what prepare's long-step plan reads, less its
    # margin, step_margin): a step the preflight passes must be one prepare accepts
    room = min(machine_room(device).bytes, limit)
    held = limit - room + step_margin(room, device)
    # on the CPU the next tier is the spill folder's disk
    return limit, source, held, HostLimit(tier_capacity("disk", spill_dir), 1.0)


def check_fits(cfg: RunConfig, device: torch.device) -> Preflight:
    """Check that ``cfg``'s step fits before any data is read; choose resident layers.

    Raises:
        ValueError: the step does not fit the real limit with these options; the message
            names the longest sequence that does, what binds, and the plan command.
    """
    why = _not_modelled(cfg)
    if why is not None:
        note = () if cfg.train.model is None else (f"plan: not checked before the data: the "
                                                   f"planner does not model {why}",)
        return Preflight(cfg, None, note)
    t = cfg.train
    try:
        shape = load_shape(t.model)
    except ValueError as e:  # a family the memory model does not know: prepare plans alone
        return Preflight(cfg, None, (f"plan: not checked before the data: {e}",))
    positions = shape.max_positions
    if t.seq_len > positions:
        raise ValueError(f"--seq-len {t.seq_len} is longer than the model allows ({positions} "
                         f"positions); pass --seq-len {positions} or less.")
    setup, sized = planned_setup(cfg, device)
    limit, source, overhead, host = real_limit(device, cfg.prepare.offload_dir)
    fit = run_fit(shape, setup, limit_bytes=limit, limit_source=source,
                  overhead_bytes=overhead, host=host, **sized)
    if not fit.fits:
        longest = fit.longest.maximum or 0
        fix = (f"pass --seq-len {longest} or less" if longest else
               "not even one token per sequence fits: use a smaller model or more memory")
        held = "" if device.type == "cuda" else f", {format_bytes(overhead)} held by the process"
        raise ValueError(
            f"--seq-len {t.seq_len} (batch {t.batch_size}) does not fit: the step is predicted "
            f"at {format_bytes(fit.row.estimate.total) if fit.row.estimate else 'n/a'} of the "
            f"{format_bytes(limit)} of {source}{held} ({_binds(fit)} binds); the longest "
            f"sequence these options fit is {longest:,} tokens; {fix} (the same question "
            f"for every configuration: `{_plan_command(t.model, setup, limit, overhead)}`).")
    notes = [f"plan: {fit.describe()}"]
    chosen = fit.row.setup.resident_layers
    if sized["paged_weights"]:  # auto: the planner's number, saved with the run's options
        cfg = replace(cfg, prepare=replace(cfg.prepare, resident_layers=chosen))
        if chosen != "all":
            notes.append(f"--resident-layers {chosen} (planned): the step fits only with the "
                         "4-bit weights of the other layers on the next tier, streamed one "
                         "layer ahead")
    return Preflight(cfg, fit, tuple(notes))


def _plan_command(model: str, setup: TrainSetup, limit: int, overhead: int) -> str:
    """The ``tightfit plan --max-seq`` line that asks what this check asked: this limit, this
    overhead (on the CPU what the process holds, with the step's margin), no further margin."""
    mib = 1 << 20
    return (f"tightfit plan --model {model} --gpu {limit // mib}MiB --overhead "
            f"{-(-overhead // mib)}MiB --margin 0 --batch-size {setup.batch_size} "
            f"--compute-dtype {setup.compute_dtype} --lora-r {setup.lora_r} --max-seq")


def _binds(fit: RunFit) -> str:
    row = fit.row
    if not row.fits_device and not row.fits_host:
        return "device and host" if fit.limit_source.endswith("memory") else "memory and disk"
    if not row.fits_device:
        return "device" if fit.limit_source.endswith("memory") else "memory"
    return "host" if fit.limit_source.endswith("memory") else "spill disk"
