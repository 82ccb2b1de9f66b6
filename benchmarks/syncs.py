"""Host syncs per paged step, per optimizer and tier, counted under the strict CUDA emulation.

A count, not a time: every ``.item()``/``.tolist()``/implicit conversion of a device tensor,
``synchronize()`` of the device, a stream or an event, and blocking host<->device copy made on
the stepping thread (``tests/tiers/strict_cuda.py``), with the optimizer's store built as on
CUDA (its copy engine, pinned host pages). Per optimizer and flag set: steps 2-4 at 8 and 64
params of 5,000 elements, three tiers (resident: no budget; streamed: a one-page device budget,
the rest in pinned host pages; disk: the same with a one-page host budget, the rest in the
spill file); then a tiny Llama's training step with every block's activations offloaded to
pinned host memory, tiled MLPs and a streamed optimizer, at 2 and 4 layers (forward /
backward / step).

Before/after: run once on each old revision (its ``tightfit`` first on ``PYTHONPATH``; the
emulation and the counter are this tree's) with ``--json before.json``, then here with a
``--before``/``--before-rev`` pair per old run (columns in that order)::

    git worktree add /tmp/wt_syncs <rev>
    PYTHONPATH=/tmp/wt_syncs .venv/bin/python benchmarks/syncs.py --json /tmp/before.json
    .venv/bin/python benchmarks/syncs.py --before /tmp/before.json --before-rev <rev>
    git worktree remove /tmp/wt_syncs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from environment import cpu_model, versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
import tightfit  # noqa: E402 (as PYTHONPATH or the venv finds it: the old code for "before")

sys.path.insert(0, str(ROOT))  # the emulation and the counter are always this tree's tests/
from tests.optim.syncs import training_step_syncs  # noqa: E402
from tests.tiers.counting import count_copies  # noqa: E402
from tests.tiers.strict_cuda import install as emulate  # noqa: E402
from tests.tiers.strict_cuda import uninstall  # noqa: E402
from tightfit.optim.adamw import PagedAdam, PagedAdamW  # noqa: E402
from tightfit.optim.adamw8bit import PagedAdam8bit, PagedAdamW8bit  # noqa: E402
from tightfit.optim.lion import PagedLion, PagedLion8bit  # noqa: E402
from tightfit.optim.sgd import PagedSGD  # noqa: E402
from tightfit.tiers.copy import CudaCopyEngine  # noqa: E402

PAGE = 16 << 10
NUMEL = 5000
CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "PagedAdamW (fused)": (PagedAdamW, {}),
    "PagedAdamW foreach": (PagedAdamW, {"foreach": True}),
    "PagedAdamW loop": (PagedAdamW, {"foreach": False}),
    "PagedAdamW foreach, tensor lr": (PagedAdamW, {"fused": False, "lr": "tensor"}),
    "PagedAdam foreach amsgrad": (PagedAdam, {"foreach": True, "amsgrad": True}),
    "PagedAdamW8bit": (PagedAdamW8bit, {}),
    "PagedAdamW8bit, tensor lr": (PagedAdamW8bit, {"lr": "tensor"}),
    "PagedAdamW8bit torch backend": (PagedAdamW8bit, {"backend": "torch", "foreach": False}),
    "PagedAdam8bit": (PagedAdam8bit, {}),
    "PagedLion (foreach)": (PagedLion, {}),
    "PagedLion, tensor lr": (PagedLion, {"lr": "tensor"}),
    "PagedLion8bit": (PagedLion8bit, {}),
    "PagedSGD momentum (fused)": (PagedSGD, {"momentum": 0.9, "fused": True}),
    "PagedSGD momentum foreach": (PagedSGD, {"momentum": 0.9, "foreach": True}),
    "PagedSGD dampening": (PagedSGD, {"momentum": 0.9, "dampening": 0.1}),
    "PagedSGD, tensor lr": (PagedSGD, {"momentum": 0.9, "lr": "tensor"}),
}
TIERS = {"resident": {}, "streamed": {"device_budget": PAGE},
         "disk": {"device_budget": PAGE, "host_budget": PAGE}}  # fmt: skip


class Emulated:
    """The strict emulation, installed for one measurement (a fresh one each)."""

    def __enter__(self) -> Any:
        self.mp = pytest.MonkeyPatch()
        self.emu = emulate(self.mp)
        count_copies(self.mp, CudaCopyEngine, emulate_accelerator=True)
        return self.emu

    def __exit__(self, *exc: object) -> None:
        try:
            self.emu.synchronize()
        finally:
            uninstall(self.emu)
            self.mp.undo()


def syncs(emu: Any, fn: Any) -> int:
    before = sum(emu.syncs.values())
    fn()
    return sum(emu.syncs.values()) - before


def optimizer_syncs(name: str, n: int, tier: str) -> list[int]:
    """Host syncs of steps 2-4 of ``name`` on ``n`` params in ``tier``."""
    cls, kw = CONFIGS[name]
    with Emulated() as emu:
        kw = dict(kw)
        if kw.get("lr") == "tensor":
            kw["lr"] = torch.full((), 1e-2)  # a device tensor (made by an op)
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(NUMEL, generator=gen)) for _ in range(n)]
        opt = cls(params, page_bytes=PAGE, **TIERS[tier], **kw)
        counts = []
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(NUMEL, generator=gen)
            counts.append(syncs(emu, opt.step))
        opt.close()
    return counts[1:]


def training_syncs(layers: int, cls: type) -> list[list[int]]:
    """(forward, backward, step) syncs of steps 2-3 of a tiny Llama, offloaded and tiled
    (the scenario of tests/optim/test_host_syncs.py)."""
    with Emulated() as emu, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = training_step_syncs(emu, layers, cls, PAGE)
    return [list(t) for t in out[1:]]


def measure() -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in CONFIGS:
        for tier in TIERS:
            key = f"{name} | {tier}"
            try:
                rows[key] = {str(n): optimizer_syncs(name, n, tier) for n in (8, 64)}
            except (TypeError, ValueError) as exc:  # the old code may refuse a flag: say so
                rows[key] = {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
            print(key, rows[key], flush=True)
    for cls in (PagedAdamW, PagedAdamW8bit):
        key = f"training step, {cls.__name__} streamed"
        rows[key] = {f"{n} layers": training_syncs(n, cls) for n in (2, 4)}
        print(key, rows[key], flush=True)
    return rows


def _cell(entry: dict[str, Any] | None, size: str) -> str:
    if entry is None:
        return "-"
    if "error" in entry:
        return "refused"
    values = entry[size]
    if isinstance(values[0], list):  # a training step: forward/backward/step
        return " / ".join(str(int(statistics.median(v[i] for v in values))) for i in range(3))
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def write(after: dict[str, Any], befores: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    """The results table: a pair of columns per old run in ``befores`` (rev, counts), then
    this tree's."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    v = versions()
    revs = ", ".join(r for r, _ in befores) or "none"
    head = "".join(f" {r}, 8 | {r}, 64 |" for r, _ in befores)
    lines = [
        "# Host syncs per paged step (strict CUDA emulation, counted)",
        "",
        f"`benchmarks/syncs.py`: after = the working tree at commit {rev}, before = "
        f"{revs} (each its tightfit; this tree's emulation and counter). A count, not a "
        "time: the load of the shared "
        f"machine does not change it (load average {os.getloadavg()[0]:.1f} at the end). "
        f"CPU {cpu_model()}; torch {v['torch']}, bitsandbytes {v['bitsandbytes']}, "
        f"transformers {v['transformers']}.",
        "",
        "Syncs per step after the first (steps 2-4; a range where they differ), at 8 and 64 "
        f"params of {NUMEL:,} elements, {PAGE >> 10} KiB pages. resident: no device budget; "
        "streamed: a one-page device budget, the rest in pinned host pages; disk: also a "
        "one-page host budget, the rest in the spill file. Training step: forward / backward "
        "/ step of a tiny Llama (activations offloaded to pinned host, MLPs tiled, state "
        "streamed) at 2 and 4 layers.",
        "",
        f"| optimizer | tier |{head} after, 8 | after, 64 |",
        "|---|---|" + "---|---|" * len(befores) + "---|---|",
    ]
    for key, entry in after.items():
        name, _, tier = key.partition(" | ")
        sizes = ["2 layers", "4 layers"] if "training" in key else ["8", "64"]
        cells = [_cell(old.get(key), s) for _, old in befores for s in sizes]
        cells += [_cell(entry, s) for s in sizes]
        lines.append(f"| {name} | {tier or 'streamed'} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each staged disk write-back waits for its page's device-to-host copy (an event "
        "synchronize) before the spill file is written. That wait is the copy worker's: "
        "where the stepping thread helped the copy queue while it waited (the old runs), it "
        "ran write-backs itself and their waits were host syncs of the step, a number that "
        "grew with the pages on disk and varied with the thread scheduling; CUDA's engine now "
        "leaves its queue to the worker (`tightfit/tiers/copy.py`), and the disk tier's "
        "counts are the streamed tier's. The forward's one sync is transformers' "
        "packed-sequence check of the position ids, not tightfit's.",
        "",
    ]
    out.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the counts here (the before run)")
    ap.add_argument("--before", type=Path, action="append", default=[],
                    help="an old run's --json file (repeat for several)")
    ap.add_argument("--before-rev", action="append", default=[],
                    help="that run's commit (one per --before, in the same order)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/syncs.md")
    args = ap.parse_args()
    if len(args.before_rev) != len(args.before):  # checked before minutes of counting
        ap.error(f"{len(args.before)} --before files but {len(args.before_rev)} --before-rev: "
                 "give one --before-rev per --before, in the same order")
    befores = [(r, json.loads(f.read_text())) for r, f in zip(args.before_rev, args.before)]
    torch.set_num_threads(1)
    print("tightfit from", Path(tightfit.__file__).parent, flush=True)
    rows = measure()
    if args.json:
        args.json.write_text(json.dumps(rows))
        return
    write(rows, befores, args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
