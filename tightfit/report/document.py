"""The memory report as data, and its renderings: a text table, JSON, Markdown, PNG bars.

A :class:`MemoryReport` holds one :class:`Piece` per memory piece (what the bytes would be
without it and are with it, measured; ``used`` says whether the piece ran at all), and, when a
training run filled them in, the step's memory as measured (``step``), what paging did
(``paging``) and each piece measured beside what ``tightfit plan`` predicted for the same
setup (``predicted``), and the run's memory over all its steps (``run``).
:mod:`tightfit.report.report` measures the pieces.

The text form (:meth:`MemoryReport.table`) fits 100 columns: the table drops the column of
pains (in report.json and report.md) and wraps its labels, long lines wrap.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tightfit.report.text import WIDTH, pack, text_table, wrap

MiB = 1 << 20
#: Detail keys whose values are bytes (printed in MiB; report.json keeps the bytes).
_BYTE_KEYS = frozenset({"device", "host", "disk", "peak_device", "paged_in", "paged_out"})


@dataclass(frozen=True)
class Piece:
    """One row of the report.

    Attributes:
        name: The piece ("base weights", "quantization constants", ...).
        pain: The memory pain it targets.
        without: What the bytes would be without the piece (label, e.g. "bf16").
        without_bytes: Bytes without the piece.
        with_: What ran (label, e.g. "NF4", or "not quantized (float32)" when the piece was
            off).
        with_bytes: Bytes as the run held them, measured.
        detail: Extra measured figures (bits per parameter, per-tier bytes, ...).
        used: Whether the piece ran; a piece that was off has no saving to show.
    """

    name: str
    pain: str
    without: str
    without_bytes: int
    with_: str
    with_bytes: int
    detail: dict[str, Any] = field(default_factory=dict)
    used: bool = True

    @property
    def saved_bytes(self) -> int:
        return self.without_bytes - self.with_bytes if self.used else 0

    @property
    def ratio(self) -> float | None:
        """``with / without``; ``None`` for a piece that was off or has nothing to compare."""
        if not self.used or not self.without_bytes:
            return None
        return self.with_bytes / self.without_bytes


@dataclass
class MemoryReport:
    """The measured per-piece report, plus what it was measured on.

    Attributes:
        pieces: One row per piece.
        meta: What the report was measured on (model, device, batch, the run's figures).
        step: The training step's memory, measured: ``device`` and ``host`` dicts of bytes
            (``peak_bytes``, ``end_of_step_bytes``, ``counted_bytes``; ``rss_bytes``,
            ``rss_peak_bytes``) and ``how`` (what measured them).
        paging: What the optimizer's pager did in the process that ended the run (since the
            start, or since the last resume: ``since_step``): moves, bytes, time, retries.
        run: The run's memory over all its steps, those before a resume included: the
            largest end-of-step total and the highest high-water mark on the device
            (``total_bytes``, ``peak_bytes``), the steps resumed at, steps retried.
        predicted: ``{"piece", "measured", "predicted"}`` per piece of ``tightfit plan``'s
            model for the same setup (empty when the planner has no model of the run).
    """

    pieces: list[Piece]
    meta: dict[str, Any] = field(default_factory=dict)
    step: dict[str, Any] = field(default_factory=dict)
    paging: dict[str, Any] = field(default_factory=dict)
    predicted: list[dict[str, Any]] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)

    def piece(self, name: str) -> Piece:
        """The row called ``name``."""
        for p in self.pieces:
            if p.name == name:
                return p
        raise KeyError(f"no piece {name!r}; pieces are {[p.name for p in self.pieces]}")

    # -- rendering -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        rows = []
        for p in self.pieces:
            d = asdict(p)
            d["with"] = d.pop("with_")
            d["saved_bytes"] = p.saved_bytes
            rows.append(d)
        return {"meta": self.meta, "pieces": rows, "step": self.step, "run": self.run,
                "paging": self.paging, "predicted": self.predicted}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def _rows(self) -> list[list[str]]:
        return [[p.name, p.pain, f"{p.without} {_mib(p.without_bytes)}",
                 f"{p.with_} {_mib(p.with_bytes)}", _ratio(p)] for p in self.pieces]

    _HEAD = ["piece", "memory pain it targets", "without", "with (measured)", "with/without"]

    def table(self) -> str:
        """The terminal's form (≤ 100 columns): the pieces (without their pains, which
        report.json and report.md give), their details, then the step, run, paging and plan
        lines."""
        lines = ["memory per piece, without it and with it (measured; ratio = with / without):"]
        rows = [[p.name, p.without, _num(p.without_bytes), p.with_, _num(p.with_bytes),
                 _ratio(p)] for p in self.pieces]
        lines += text_table(["piece", "without", "MiB", "with (measured)", "MiB", "ratio"],
                            rows, wrap_columns=(0, 1, 3), right=(2, 4))
        lines += [wrap(f"  {line}", indent=4) for line in self._detail_lines(in_mib=True)]
        lines += [wrap(line) for line in self._run_lines(terminal=True)]
        if self.predicted:
            lines += ["", "measured vs predicted by tightfit plan (the same setup):"]
            lines += [f"  {line}" for line in text_table(*self._predicted_rows(), width=98,
                                                         wrap_columns=(0,), right=(1, 2, 3))]
        return "\n".join(lines)

    def _detail_lines(self, in_mib: bool = False) -> list[str]:
        return [f"{p.name}: " + ", ".join(f"{k}={_detail(k, v, in_mib)}"
                                          for k, v in p.detail.items())
                for p in self.pieces if p.detail]

    def _run_lines(self, terminal: bool = False) -> list[str]:
        """The step, run and paging lines; ``terminal``: the paging line split in four and
        the measuring method left to report.json / report.md."""
        lines = []
        if self.step:
            how = f" [{self.step['how']}]" if self.step.get("how") and not terminal else ""
            lines += (pack(step_parts(self.step), "step memory (measured): ") if terminal
                      else ["step memory (measured): " + step_text(self.step) + how])
        if self.run:
            head, figures, how = run_parts(self.run)
            one = f"{head}: {figures}"
            lines += (([one] if len(one) <= WIDTH else [head, f"  {figures}"]) + [f"  {how}"]
                      if terminal else [f"{one} {how}"])
        if self.paging:
            parts = paging_parts(self.paging)
            lines += ([f"paging: {parts[0]}", *(f"  {x}" for x in parts[1:])] if terminal
                      else ["paging: " + "; ".join(parts)])
        return lines

    def _predicted_rows(self) -> tuple[list[str], list[list[str]]]:
        head = ["piece", "measured", "predicted", "predicted/measured"]
        rows = [[r["piece"], _mib(r["measured"]), _mib(r["predicted"]),
                 f"{r['predicted'] / r['measured']:.3f}" if r["measured"] else "—"]
                for r in self.predicted]
        return head, rows

    def to_markdown(self) -> str:
        """The report as a Markdown document."""
        lines = ["# tightfit memory report", ""]
        if self.meta:
            lines += [f"- {k}: {_fmt(v)}" for k, v in self.meta.items()] + [""]
        lines += _md_table(self._HEAD, self._rows())
        lines += ["", "Details (measured):", ""]
        lines += [f"- {line}" for line in self._detail_lines()]
        if self._run_lines():
            lines += ["", "The run (measured):", ""] + [f"- {x}" for x in self._run_lines()]
        if self.predicted:
            lines += ["", "Measured vs predicted by `tightfit plan` (the same setup):", ""]
            lines += _md_table(*self._predicted_rows())
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Bar chart (MiB, without vs with, for the pieces that ran) saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [p for p in self.pieces if p.used]
        x = range(len(shown))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.bar([i - 0.2 for i in x], [p.without_bytes / MiB for p in shown], 0.4,
               label="without the piece", color="#bbbbbb")
        ax.bar([i + 0.2 for i in x], [p.with_bytes / MiB for p in shown], 0.4,
               label="with (measured)", color="#2b7bba")
        ax.set_xticks(list(x), [p.name for p in shown], rotation=20, ha="right")
        ax.set_ylabel("MiB")
        ax.set_yscale("log")
        for i, p in enumerate(shown):
            if p.ratio is not None:
                ax.annotate(f"{p.ratio:.2f}x", (i + 0.2, max(p.with_bytes / MiB, 1e-6)),
                            ha="center", va="bottom", fontsize=8)
        off = [p.name for p in self.pieces if not p.used]
        ax.set_title("tightfit: memory per piece, without vs with"
                     + (f"\n(off in this run: {', '.join(off)})" if off else ""), fontsize=10)
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def save(self, folder: str | os.PathLike[str]) -> dict[str, Path]:
        """Write ``report.json``, ``report.md`` and ``memory_report.png`` into ``folder``."""
        d = Path(folder)
        d.mkdir(parents=True, exist_ok=True)
        paths = {"json": d / "report.json", "md": d / "report.md", "png": d / "memory_report.png"}
        _atomic_write(paths["json"], self.to_json())
        _atomic_write(paths["md"], self.to_markdown())
        self.plot(paths["png"])
        return paths


def step_parts(step: dict[str, Any]) -> list[str]:
    """The step's memory: device peak and end of step, the pieces counted, host RSS and its
    peak."""
    dev, host = step.get("device", {}), step.get("host", {})
    parts = []
    if dev.get("peak_bytes") is not None:
        parts.append(f"device peak {_mib(dev['peak_bytes'])}")
    if dev.get("end_of_step_bytes") is not None:
        parts.append(f"{_mib(dev['end_of_step_bytes'])} at the end of the last step")
    if dev.get("counted_bytes") is not None:
        parts.append(f"pieces counted {_mib(dev['counted_bytes'])}")
    if host.get("rss_bytes") is not None:
        parts.append(f"host RSS {_mib(host['rss_bytes'])}, peak {_mib(host['rss_peak_bytes'])}")
    return parts


def step_text(step: dict[str, Any]) -> str:
    """The step's memory in one line (:func:`step_parts`)."""
    return "; ".join(step_parts(step))


def run_parts(run: dict[str, Any]) -> list[str]:
    """The run's memory over all its steps: the steps (and those resumed at), the largest
    end-of-step total and the highest high-water mark on the device, how they were measured."""
    resumed = run.get("resumed_at") or []
    at = (f", resumed at step{'s' if len(resumed) > 1 else ''} {', '.join(map(str, resumed))}"
          if resumed else "")
    return [f"run (steps {run.get('first_step')}-{run.get('last_step')}{at})",
            f"device total {_mib(run.get('total_bytes'))} at most, peak "
            f"{_mib(run.get('peak_bytes'))}", f"({run.get('measured_as')})"]


def paging_parts(p: dict[str, Any]) -> list[str]:
    """What the pager did: the target, the moves, the bytes and time, the out-of-memory count."""
    if p.get("target_bytes") is not None:
        head = f"target {_mib(p['target_bytes'])} ({p.get('target_option')})"
    else:
        head = f"no target ({p.get('target_option')})"
    if p.get("since_step"):
        head += f"; since the resume at step {p['since_step']}"
    share = p.get("pressure_share")
    return [
        head,
        f"{p.get('evictions', 0)} evictions ({_mib(p.get('evicted_bytes', 0))} off the device), "
        f"{p.get('restores', 0)} restores ({_mib(p.get('restored_bytes', 0))} back)",
        f"{_mib(p.get('bytes_paged_in', 0))} paged in, {_mib(p.get('bytes_paged_out', 0))} out "
        f"in all; {p.get('pressure_seconds', 0.0):.2f} s on pressure"
        + (f" ({100 * share:.1f} % of step time)" if share is not None else ""),
        f"out of memory: {p.get('oom_recoveries', 0)} recovered inside step(), "
        f"{p.get('oom_retries', 0)} steps retried",
    ]


def _num(n: int | float) -> str:
    return f"{n / MiB:.2f}"


def _ratio(p: Piece) -> str:
    return "off" if not p.used else "—" if p.ratio is None else f"{p.ratio:.3f}"


def _detail(key: str, v: Any, in_mib: bool) -> str:
    if in_mib and isinstance(v, int) and (key in _BYTE_KEYS or key.endswith("_bytes")):
        return _mib(v)
    return _fmt(v)


def _mib(n: int | float | None) -> str:
    return "—" if n is None else f"{n / MiB:.2f} MiB"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
