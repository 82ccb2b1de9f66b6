"""The ladder's answer (:class:`PlanReport`, one :class:`Row` per configuration) and the table
``tightfit plan`` prints of it (text or ``--json``); on more than one GPU, per rank
(:mod:`tightfit.planner.ranks`), with the fewest GPUs that fit (:class:`Fewest`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from tightfit.measure.sizes import format_bytes
from tightfit.planner.estimate import Estimate, Overhead
from tightfit.planner.host import HostLimit
from tightfit.planner.presets import ModelShape
from tightfit.planner.ranks import RankEstimate
from tightfit.planner.train_setup import RECOMPUTED, TrainSetup

# The figures of a row in --json: null for a configuration that does not apply
_FIGURES = ("total_bytes", "pieces_bytes", "host_bytes", "host_activation_bytes",
            "optimizer_offloaded_bytes", "host_weight_bytes", "paging_bytes_per_step", "slowdown",
            "recompute_fraction", "checkpoint_segments", "segments")
# torchrun's form of the train line, on more than one GPU
TORCHRUN = "torchrun --nproc_per_node {n} -m tightfit.cli train"


@dataclass(frozen=True)
class Row:
    """One configuration of the plan.

    ``fits`` is ``fits_device and fits_host`` with the plan's safety margin left free on the
    device; ``tight``: it fits the device only inside that margin. Under ``maximize``,
    ``maximum`` is the longest sequence (largest batch) that fits, 0 when not even the
    smallest does, and the row's figures are at that size; ``limit`` says what stops it:
    ``"device"``, ``"host"``, ``"positions"`` (the model's position limit) or
    ``"nothing fits"``. A configuration that does not apply to the model's family (a tiled
    MLP for MoE experts) has ``not_applicable`` (why), no ``estimate``, no command, and is
    never recommended.
    """

    name: str
    setup: TrainSetup
    estimate: Estimate | None
    fits: bool
    slowdown: float
    paging_bytes_per_step: int
    train_args: tuple[str, ...]
    fits_device: bool = True
    fits_host: bool = True
    maximum: int | None = None
    limit: str | None = None
    tight: bool = False
    not_applicable: str | None = None

    @classmethod
    def inapplicable(cls, name: str, setup: TrainSetup, why: str) -> Row:
        """The row of a configuration that does not apply (``why``) to the model."""
        return cls(name, setup, None, False, 0.0, 0, (), fits_device=False, fits_host=False,
                   not_applicable=why)

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        figures: dict[str, Any] = dict.fromkeys(_FIGURES) if e is None else {
            "total_bytes": e.total,
            "pieces_bytes": e.pieces(),
            "host_bytes": e.host,
            "host_activation_bytes": e.host_activations,
            "optimizer_offloaded_bytes": e.optimizer_offloaded,
            "host_weight_bytes": e.host_weights,
            "paging_bytes_per_step": self.paging_bytes_per_step,
            "slowdown": round(self.slowdown, 3),
            "recompute_fraction": round(e.recompute_fraction, 4),
            # [start, stop, checkpointed] per segment (docs/plan.md)
            "checkpoint_segments": [[s.start, s.stop, s.kind in RECOMPUTED]
                                    for s in e.segments],
            # [start, stop, kind] per segment, kinds as tightfit.checkpoint.plan names them
            "segments": [[s.start, s.stop, s.kind] for s in e.segments],
        }
        if isinstance(e, RankEstimate):  # one rank of several
            figures.update(ranks=e.ranks, sharded=e.sharded, ddp=e.ddp,
                           start_peak_bytes=e.start_peak, block_bytes=e.block_bytes,
                           root_bytes=e.root_bytes)
        return {
            "name": self.name,
            "fits": self.fits,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "tight": self.tight,
            "not_applicable": self.not_applicable,
            **figures,
            "setup": {k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in vars(self.setup).items()},
            "train_args": list(self.train_args),
            "maximum": self.maximum,
            "limit": self.limit,
        }


@dataclass(frozen=True)
class Fewest:
    """The fewest GPUs of the plan's size on which a row fits the step.

    Attributes:
        gpus: That count; 0 when none up to ``searched_to`` does.
        row: The row recommended there (per rank), ``None`` when none fits.
        searched_to: The largest count tried (the batch must split over it).
    """

    gpus: int
    row: Row | None
    searched_to: int

    def to_dict(self) -> dict[str, Any]:
        r = self.row
        return {"gpus": self.gpus, "searched_to": self.searched_to,
                "row": None if r is None else r.name,
                "total_bytes": None if r is None or r.estimate is None else r.estimate.total,
                "train_args": None if r is None else list(r.train_args)}


@dataclass(frozen=True)
class PlanReport:
    """The answer of :func:`plan`: every configuration, and the one to use; with ``gpus``
    > 1 every figure is one rank's; ``fewest``: the fewest GPUs that fit (``None``: not
    searched: one GPU that fits, or a ``maximize`` plan)."""

    shape: ModelShape
    gpu_bytes: int
    overhead: Overhead
    rows: tuple[Row, ...]
    recommended: Row | None
    notes: tuple[str, ...] = field(default=())
    host: HostLimit | None = None
    maximize: str | None = None
    granularity: int = 1
    margin_bytes: int = 0
    model_dir: str | None = None  # the model folder, when plan was given one (or its config)
    gpus: int = 1
    fewest: Fewest | None = None

    def to_dict(self) -> dict[str, Any]:
        host = self.host
        return {
            "model": vars(self.shape),
            "params": self.shape.num_params(),
            "gpu_bytes": self.gpu_bytes,
            "overhead": {"fixed_bytes": self.overhead.fixed_bytes,
                         "fraction": self.overhead.fraction},
            "margin_bytes": self.margin_bytes,
            "host": None if host is None else {
                "ram_bytes": host.ram_bytes, "pinned_fraction": host.pinned_fraction,
                "budget_bytes": host.budget, "measured": host.measured},
            "maximize": self.maximize,
            "granularity": self.granularity,
            "rows": [r.to_dict() for r in self.rows],
            "recommended": None if self.recommended is None else self.recommended.name,
            "model_dir": self.model_dir,
            "notes": list(self.notes),
            "gpus": self.gpus,
            "fewest": None if self.fewest is None else self.fewest.to_dict(),
        }

    def __str__(self) -> str:
        return render(self)


_COLUMNS = (
    ("weights", "weights"),
    ("consts", "constants"),
    ("LoRA", "lora"),
    ("grads", "grads"),
    ("optim", "optimizer"),
    ("activ", "activations"),
    ("logits", "logits_loss"),
    ("overhd", "overhead"),
)
# per rank of several: the parameters gathered in flight and the collectives' buffers
_RANK_COLUMNS = (*_COLUMNS[:5], ("gather", "gathered"), ("comm", "comm"), *_COLUMNS[5:])


def _columns(report: PlanReport) -> tuple[tuple[str, str], ...]:
    return _RANK_COLUMNS if report.gpus > 1 else _COLUMNS


def _unit(gpu_bytes: int) -> tuple[str, int]:
    """Print GiB for real devices, MiB (or KiB) for the small ones ``--verify`` runs."""
    if gpu_bytes >= 4 * 1024**3:
        return "GiB", 1024**3
    if gpu_bytes >= 4 * 1024**2:
        return "MiB", 1024**2
    return "KiB", 1024


def _fits(r: Row) -> str:
    if r.not_applicable is not None:
        return "n/a"
    if r.fits:
        return "yes"
    if r.tight:
        return "tight"
    return "NO" if not r.fits_device else "HOST"


def _header_lines(report: PlanReport) -> list[str]:
    s = report.shape
    setup = report.rows[0].setup if report.rows else None
    lines = [f"model {s.name}: {s.describe()}"]
    if setup is not None:
        batch = "the largest batch" if report.maximize == "batch" else f"batch {setup.batch_size}"
        seq = ("the longest sequence" if report.maximize == "seq"
               else f"{setup.seq_len} tokens")
        targets = ("all linears" if setup.lora_target_modules == "all-linear"
                   else ",".join(setup.lora_target_modules))
        if report.gpus > 1 and report.maximize != "batch":
            batch = (f"batch {setup.batch_size * report.gpus} ({setup.batch_size} per rank of "
                     f"{report.gpus})")
        lines.append(
            f"step: {batch} x {seq}, {setup.compute_dtype} compute, "
            f"LoRA r={setup.lora_r} on {targets} ({setup.lora_dtype} adapters)"
        )
    unit, _ = _unit(report.gpu_bytes)
    host = ""
    if report.host is not None:
        host = f", host {format_bytes(report.host.budget)} pinned"
        if report.gpus > 1:
            host += f" ({format_bytes(report.host.budget // report.gpus)} a rank)"
    if report.gpus > 1:
        lines.append(f"devices: {report.gpus} x {format_bytes(report.gpu_bytes)}{host}   "
                     f"(sizes below per rank, in {unit}; torchrun --nproc_per_node "
                     f"{report.gpus}, FSDP2)")
    else:
        lines.append(f"device: {format_bytes(report.gpu_bytes)}{host}   (sizes below in {unit})")
    return lines


def _table_lines(report: PlanReport) -> list[str]:
    rows = report.rows
    _, scale = _unit(report.gpu_bytes)
    name_w = max([len(r.name) for r in rows] + [13]) + 1
    maxed = report.maximize is not None
    first = f"{'max ' + report.maximize:>10}" if maxed else ""
    header = f"{'#':>2} {'configuration':<{name_w}}{first}"
    columns = _columns(report)
    header += "".join(f"{c:>8}" for c, _ in columns)
    header += f"{'total':>8}{'host':>8}  {'fits':<5} {'slowdown':>8}"
    lines = [header, "-" * len(header)]
    for i, r in enumerate(rows, 1):
        mark = "*" if r is report.recommended else " "
        line = f"{i:>2}{mark}{r.name:<{name_w}}"
        e = r.estimate
        if e is None:  # does not apply: no figures (the note line says why)
            line += (f"{'-':>10}" if maxed else "") + f"{'-':>8}" * (len(columns) + 2)
            lines.append(line + f"  {_fits(r):<5} {'-':>8}")
            continue
        if maxed:
            line += f"{r.maximum or 0:>10,}"
        p = e.pieces()
        line += "".join(f"{p[k] / scale:>8.2f}" for _, k in columns)
        line += f"{e.total / scale:>8.2f}{e.host / scale:>8.2f}"
        line += f"  {_fits(r):<5} {r.slowdown:>7.2f}x"
        lines.append(line)
    return lines


def _row_notes(r: Row, layers: int) -> list[str]:
    e, setup = r.estimate, r.setup
    if e is None:
        return [f"n/a: {r.not_applicable}"]
    extra = _rank_notes(e)
    if r.limit is not None:
        extra.append(f"limit: {r.limit}")
    if e.segments and setup.checkpoint != "none":
        ck = [seg for seg in e.segments if seg.kind in RECOMPUTED]
        extra.append(f"checkpoint {setup.checkpoint}: {sum(map(len, ck))}/{layers} "
                     f"layers recomputed in {len(ck)} segments")
    if e.host_activations:
        what = "layer inputs" if setup.offload == "inputs" else "activations"
        extra.append(f"{what} {format_bytes(e.host_activations)} on the host")
    if e.host_weights and not setup.fsdp_offload:  # FSDP2's host shards: the rank's note
        extra.append(f"base weights: {setup.resident_layers}/{layers} layers resident, "
                     f"{format_bytes(e.host_weights)} on the host")
    if setup.mlp_tile is not None:
        extra.append(f"MLP in tiles of {setup.mlp_tile} tokens")
    if setup.loss_chunk_tokens:
        extra.append(f"loss in chunks of {setup.loss_chunk_tokens} tokens")
    if e.optimizer_offloaded:
        extra.append(f"optimizer {format_bytes(e.optimizer_offloaded)} on the host, "
                     f"{format_bytes(r.paging_bytes_per_step)}/step paged")
    if not r.fits_host and setup.host_budget is not None:
        extra.append(f"host needs {format_bytes(e.host)} of {format_bytes(setup.host_budget)} "
                     "pinned: does not fit")
    return extra


def _rank_notes(e: Estimate) -> list[str]:
    """How one rank's bytes come about (none on one GPU)."""
    if not isinstance(e, RankEstimate) or e.ranks == 1:
        return []
    if e.ddp is not None:
        return [f"DDP only: {e.ddp}"]
    head = "head = embeddings" if e.shape.tie_embeddings else "head"
    text = (f"FSDP2: everything sharded 1/{e.ranks}; gathered: the root ({head}, final norm) "
            f"{format_bytes(e.root_bytes)} + 2 blocks of {format_bytes(e.block_bytes)}")
    if e.setup.fsdp_offload:
        text += (f"; the shards and the optimizer step on the host (--fsdp-offload): "
                 f"{format_bytes(e.host_weights)} a rank")
    if e.start_peak >= sum(e.pieces().values()):
        text += f"; peak at forward's start (the embeddings gathered): {format_bytes(e.start_peak)}"
    return [text]


def _command(report: PlanReport, r: Row) -> str:
    """The train line of ``r``: torchrun's form on more than one GPU."""
    # the folder plan read the config of; DIR for a preset (its weights are not here)
    model = "DIR" if report.model_dir is None else shlex.quote(report.model_dir)
    args = list(r.train_args)
    n = r.estimate.ranks if isinstance(r.estimate, RankEstimate) else 1
    lead = TORCHRUN.format(n=n) if n > 1 else "tightfit train"
    fsdp = ["--fsdp"] if args[:1] == ["--fsdp"] else []
    return " ".join([lead, *fsdp, "--model", model,
                     *(shlex.quote(a) for a in args[len(fsdp):])])


def _fewest_lines(report: PlanReport) -> list[str]:
    """The fewest GPUs of this size that fit the step, and their train line."""
    f = report.fewest
    if f is None:
        return []
    size = format_bytes(report.gpu_bytes)
    if f.gpus == 0 or f.row is None or f.row.estimate is None:
        return [f"fewest GPUs: none up to {f.searched_to} x {size} fits this step (what a "
                "rank gathers, the head, the embeddings and two blocks, and its own rows' "
                "activations do not shrink with more GPUs); try a larger --gpu"]
    r = f.row
    names = [x.name for x in report.rows]
    number = f"#{names.index(r.name) + 1} " if r.name in names else ""
    where = (" (this plan)" if f.gpus == report.gpus
             else f" (its table: tightfit plan ... --gpus {f.gpus})")
    per = " per rank" if f.gpus > 1 else ""
    lines = [f"fewest GPUs: {f.gpus} x {size} — {number}{r.name}, "
             f"{format_bytes(r.estimate.total)} predicted{per}{where}"]
    if f.gpus != report.gpus:
        lines.append("  " + _command(report, r))
    return lines


def _answer_lines(report: PlanReport) -> list[str]:
    rows = report.rows
    r = report.recommended
    if r is None or r.estimate is None:
        return _nothing_fits(report)
    headroom = report.gpu_bytes - r.estimate.total
    if report.maximize is not None:
        size = (f"{r.maximum:,} tokens per sequence" if report.maximize == "seq"
                else f"batch {r.maximum}")
        lines = [f"longest: #{rows.index(r) + 1} {r.name} — {size} ({r.limit} binds), "
                 f"{format_bytes(r.estimate.total)} predicted, ~{r.slowdown:.2f}x step time"]
    else:
        lines = [f"recommended: #{rows.index(r) + 1} {r.name} — "
                 f"{format_bytes(r.estimate.total)} predicted, "
                 f"{format_bytes(headroom)} to spare, ~{r.slowdown:.2f}x step time"]
    if report.gpus > 1:
        lines[0] = lines[0].replace(" predicted", " predicted per rank", 1)
    lines.append("  " + _command(report, r))
    return lines + _fewest_lines(report)


def _nothing_fits(report: PlanReport) -> list[str]:
    """Why no row is recommended: the smallest total any row needs, and the tight rows."""
    rows = report.rows
    total, smallest = min(((r.estimate.total, i) for i, r in enumerate(rows)
                           if r.estimate is not None), default=(0, 0))
    room = format_bytes(report.gpu_bytes - report.margin_bytes)
    need = (f"the smallest configuration (#{smallest + 1} {rows[smallest].name}) needs "
            f"{format_bytes(total)}; {room} of "
            f"{format_bytes(report.gpu_bytes)} may be filled with the margin")
    if report.maximize is not None:
        unit = "tokens" if report.maximize == "seq" else "sequences"
        lines = [f"nothing fits at even {report.granularity} {unit}: {need}; try a larger --gpu."]
    else:
        lines = [f"nothing fits: {need}; try a shorter --seq-len, a smaller --batch-size or a "
                 "larger --gpu" + (", or more GPUs (--gpus)" if report.fewest and report.fewest.gpus > report.gpus
                     else "") + "."]
    tight = [f"#{rows.index(t) + 1}" for t in rows if t.tight]
    if tight:
        lines.append(f"  tight (fits only inside the margin): {', '.join(tight)}; --margin 0 "
                     "accepts it at the risk of running out of memory")
    return lines + _fewest_lines(report)


def render(report: PlanReport) -> str:
    """The plan as text: model line, per-configuration table (GiB), recommendation."""
    lines = _header_lines(report) + [""] + _table_lines(report) + [""]
    for i, r in enumerate(report.rows, 1):
        extra = _row_notes(r, report.shape.layers)
        if extra:
            lines.append(f"{i:>2}: " + "; ".join(extra))
    lines.append("")
    lines += _answer_lines(report)
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
