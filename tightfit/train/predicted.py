"""What ``tightfit plan`` predicts for the setup a run used, beside what the run measured.

The run's options and its report's batch become a :class:`~tightfit.planner.train_setup.TrainSetup`
(the same names, :mod:`tightfit.planner.train_args`), the model's config a
:class:`~tightfit.planner.presets.ModelShape`; :func:`~tightfit.planner.estimate.estimate`
then predicts every piece, and each is paired with the run's measured figure. Where the
planner has no model of the run (an architecture outside the Llama family, an optimizer or a
checkpoint policy it does not model) the comparison is left out and the reason given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tightfit.checkpoint.long_step import usable_room
from tightfit.checkpoint.tiling import auto_tile_tokens
from tightfit.loss import auto_chunk_tokens
from tightfit.measure.dtypes import dtype_name
from tightfit.planner.estimate import Estimate, Overhead, estimate
from tightfit.planner.presets import shape_from_config
from tightfit.planner.train_setup import ALL_LINEAR, PLANNED_OPTIMIZERS, TrainSetup
from tightfit.pressure.occupancy import default_probe
from tightfit.pressure.room import machine_room
from tightfit.qlora.prepare import PrepareInfo
from tightfit.report.document import MemoryReport
from tightfit.train.run_options import RunConfig

if TYPE_CHECKING:
    from tightfit.train.run_setup import Run


def planned_estimate(run: Run) -> tuple[Estimate | None, str]:
    """The planner's estimate for the run's setup at its report batch, or ``None`` and why."""
    info, cfg = run.info, run.cfg
    config = getattr(run.model, "config", None)
    if config is None:
        return None, "the model has no Hugging Face config for tightfit plan to read"
    lora = info.lora
    targets = ALL_LINEAR if lora is None or lora.target_modules == "all-linear" else tuple(
        lora.target_modules)
    if lora is None or any(t not in ALL_LINEAR for t in targets):
        return None, "tightfit plan models LoRA on the Llama projections only"
    if cfg.optimizer.kind not in PLANNED_OPTIMIZERS:
        return None, f"tightfit plan does not model --optimizer {cfg.optimizer.kind}"
    plan = info.plan
    policy = "none" if plan is None else plan.policy
    if policy == "selective":
        return None, "tightfit plan does not model --checkpoint selective"
    rows, length = (int(n) for n in run.job.rows(run.example)["input_ids"].shape)
    try:
        shape = shape_from_config(config.to_dict(), name=type(run.model).__name__)
        setup = TrainSetup(
            seq_len=length, batch_size=rows,
            compute_dtype=dtype_name(str(info.compute_dtype).removeprefix("torch.")),
            # FP4 is stored as NF4 is (two values a byte, the same constants)
            quant="nf4" if info.options.quant is not None else "none",
            double_quant=info.options.double_quant, blocksize=info.options.blocksize,
            lora_r=lora.r, lora_target_modules=targets, lora_dropout=lora.dropout,
            lora_dtype=lora.dtype, lora_compute=lora.compute,
            checkpoint=policy,
            checkpoint_budget=getattr(plan, "budget_bytes", None) if policy == "budget" else None,
            optimizer=cfg.optimizer.kind,
            optimizer_device_budget=_device_budget(run, cfg),
            loss_chunk_tokens=_chunk_tokens(info, shape.vocab, length, rows),
            # the placements prepare installed: the planner prices each of them
            offload=_offload(plan),
            mlp_tile=_tile_tokens(info, shape.hidden, shape.intermediate, length * rows),
            # a number once the preflight planned it; 'auto' unplanned keeps every layer
            resident_layers=(info.options.resident_layers
                             if isinstance(info.options.resident_layers, int) else "all"),
        )
        overhead = Overhead() if run.device.type == "cuda" else Overhead(0, 0.0)
        return estimate(shape, setup, overhead), ""
    except ValueError as exc:
        return None, f"tightfit plan cannot model this run: {exc}"


def _device_budget(run: Run, cfg: RunConfig) -> int | None:
    """The device budget the run's optimizer pages under: the one it was built with (the
    built-in demo sets its own), else the option as given."""
    stats = getattr(run.optimizer, "memory_stats", None)
    budget = stats().get("device_budget") if callable(stats) else None
    return cfg.optimizer.device_budget if budget is None else int(budget)


def _offload(plan: Any) -> str:
    """The planner's name for what the plan offloads: the inputs of checkpointed segments,
    stored segments' saved tensors too (``"all"``), or nothing."""
    kinds = {s.kind for s in getattr(plan, "segments", ()) if s.offloads}
    return "all" if "stored_offload" in kinds else "inputs" if kinds else "none"


def _tile_tokens(info: PrepareInfo, hidden: int, intermediate: int, tokens: int) -> int | None:
    """Tokens per MLP tile as the run tiled them (``None``: untiled)."""
    tiling = info.tiling
    if tiling is None or not tiling.layers:
        return None
    if tiling.tile_tokens == "auto":
        return auto_tile_tokens(hidden, intermediate, tokens)
    return int(tiling.tile_tokens)


def _chunk_tokens(info: PrepareInfo, vocab: int, length: int, rows: int) -> int | None:
    """Tokens per loss chunk as the run used them (``"auto"`` resolved for this batch)."""
    chunks = info.loss_chunks
    if chunks is None:
        return None
    if chunks == "auto":
        return auto_chunk_tokens(vocab, length, rows, info.compute_dtype)
    return int(chunks)


def compare(report: MemoryReport, est: Estimate, device_peak: int | None) -> list[dict[str, Any]]:
    """Each predicted piece beside the report's measured figure for it."""
    w, c = report.piece("base weights"), report.piece("quantization constants")
    t, a = report.piece("trainable params + grads"), report.piece("activations")
    measured_weights = w.with_bytes + int(report.meta.get("frozen_other_bytes", 0))
    rows = [
        ("weights (base + embeddings, head, norms)", measured_weights, est.weights),
        ("quantization constants", c.with_bytes + int(c.detail.get("lookup_table_bytes", 0)),
         est.constants),
        ("LoRA params", int(t.detail["param_bytes"]), est.lora),
        ("LoRA grads", int(t.detail["grad_bytes"]), est.grads),
        ("activation peak (layers + head/loss)", a.with_bytes, est.activation_peak),
    ]
    counted = sum(m for _, m, _ in rows)
    opt = next((p for p in report.pieces if p.name == "optimizer state"), None)
    if opt is not None:
        rows.append(("optimizer state", opt.with_bytes, est.optimizer + est.optimizer_offloaded))
        on_device = min(opt.with_bytes, int(opt.detail.get("device", opt.with_bytes)))
        rows.append(("optimizer state on the device", on_device, est.optimizer))
        counted += on_device
    if device_peak is not None:
        rows.append(("step total (device peak; predicted with overhead)", device_peak, est.total))
    else:
        rows.append(("step total (the pieces above, device)", counted, est.total))
    return [{"piece": name, "measured": int(m), "predicted": int(p)} for name, m, p in rows]



def predicted_without_pass(run: Run, stats: dict[str, Any]) -> int | None:
    """The predicted activation peak of the report's step without the plan and the chunked
    loss, when running it could pass the memory target or the machine's room; ``None``:
    measure it.

    The report runs the run's longest batch once more with both pieces off. That step must
    fit what the machine has free now, less the long step's margin (a memory cgroup kills at
    its limit; it does not raise), and with a target (pressure on) under the target too: the
    target less what is in use now, plus the optimizer's pages (the watch drains them first).
    When the planner predicts more than either room, the report shows the prediction instead
    of risking the run's end.
    """
    est, _ = planned_estimate(run)
    if est is None:
        return None
    # the plan off (its offload with it) and the loss unchunked; the MLP tiles stay, as in
    # report.pieces.memory_pieces_off
    try:
        bare = estimate(est.shape, est.setup.with_(checkpoint="none", checkpoint_budget=None,
                                                   offload="none", loss_chunk_tokens=None),
                        Overhead(0, 0.0))
    except ValueError:  # a setup the planner models with the plan but not without it
        return None
    if bare.activation_peak > usable_room(machine_room(run.device), run.device):
        return bare.activation_peak
    target = stats.get("target_bytes")
    if target is None:
        return None
    probe = default_probe(run.device)
    room = int(target) - probe.used_bytes() + int(stats.get("device_bytes", 0))
    extra = bare.activation_peak - est.activation_peak
    return bare.activation_peak if extra > room else None
