"""``tightfit train`` itself under a memory cap, on data with a few long examples.

The proof that the main job is spike-proof by default: the benchmark runs the command line
as a user would (``python -m tightfit train --model DIR --data FILE ...``), each run in its
own process and, where asked, its own memory cgroup (see ``benchmarks/spike.py``, whose cap
detection it uses), on JSONL text records where a few long examples sit among many short
ones (``--batching bucket`` puts the long ones in a few long batches: the spikes).

1. calibration: no cap, ``--target none``: the training peak (cgroup charge and RSS);
2. under a cap below that peak: ``--target none`` (expected: killed) and the defaults
   (expected: completes, with the same adapter as the uncapped run: paging is exact);
3. the default's fraction (``--target auto`` = 0.9 of the cgroup limit): each of a few
   fractions under the cap (which survive, what pressure costs);
4. cost: the defaults against ``--target none`` on the same data in one cgroup whose limit
   leaves ``--target none`` room (so both finish), and on short examples only (no spike);
   runs alternate, and each run's own time on pressure is measured inside it.

Writes ``benchmarks/results/spike_cli.md``.

Usage::

    .venv/bin/python benchmarks/spike_cli.py            # full run (8 runs, ~10 min on 2 busy cores)
    .venv/bin/python benchmarks/spike_cli.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from environment import cpu_model, git_commit, load_text, versions_text
from safetensors.torch import load_file
from spike import Cap, cgroup_figures, child_cgroup, detect_cap

MiB = 2**20
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORDS = ["the", "a", "of", "paged", "optimizer", "state", "spike", "memory", "long", "short",
         "batch", "token", "device", "host", "disk", "page", "target", "watch", "evict",
         "restore", "step"]


# ---------------------------------------------------------------------------- inputs
def make_inputs(folder: Path, ns: argparse.Namespace) -> tuple[Path, Path, Path]:
    """A Llama folder (random weights, byte vocabulary), spike data and short-only data."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: only when making inputs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=ns.hidden, intermediate_size=2 * ns.hidden,
                      num_hidden_layers=ns.layers, num_attention_heads=ns.heads,
                      num_key_value_heads=ns.heads, max_position_embeddings=ns.long + 64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder / "model")
    rng = random.Random(0)

    def text(n: int) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n:
            words.append(rng.choice(WORDS))
        return " ".join(words)[:n]

    short = [{"text": text(rng.randint(40, 90))} for _ in range(ns.examples)]
    spiky = list(short)
    for _ in range(ns.long_examples):
        spiky.insert(rng.randrange(len(spiky)), {"text": text(ns.long)})
    for name, recs in (("spike.jsonl", spiky), ("short.jsonl", short)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder / "model", folder / "spike.jsonl", folder / "short.jsonl"


# ---------------------------------------------------------------------------- one run
@dataclass
class Run:
    """One ``tightfit train`` process: how it ended and what it measured."""

    label: str
    returncode: int
    killed: bool
    steps_done: int
    maxrss: int
    cgroup_peak: int | None
    oom_kills: int | None
    wall_s: float
    anon_peak: int | None = None  # the cgroup's anonymous memory, sampled (what it kills for)
    setup_anon_peak: int | None = None  # the same before the first step
    report: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if self.killed:
            return f"killed (SIGKILL) after {self.steps_done} steps"
        return "completed" if self.returncode == 0 else f"exit code {self.returncode}"


def train(label: str, out: Path, model: Path, data: Path, ns: argparse.Namespace, cap: Cap,
          limit: int | None, extra: tuple[str, ...] = ()) -> Run:
    """``python -m tightfit -v train ...`` in a cgroup (with ``limit``, or none: measured)."""
    cmd = [sys.executable, "-m", "tightfit", "-v", "train", "--model", str(model), "--data",
           str(data), "--format", "text", "--out", str(out), "--steps", str(ns.steps),
           "--batch-size", "2", "--seq-len", str(ns.long), "--lora-r", str(ns.lora_r),
           "--lora-alpha", str(ns.lora_r), "--threads", "1", "--save-every", "1000",
           "--track-every", "0", "--spill-dir", str(out.parent / "spill"), "--tokenizer", "bytes",
           *extra]
    cg, preexec = child_cgroup(cap, limit, "tightfit-spike-cli")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                preexec_fn=preexec)
        anon = AnonPeak(cap, cg, out.parent / f"{out.name}.log", f"step {ns.steps} done:")
        _, status, usage = os.wait4(proc.pid, 0)
        anon.stop()
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    peak, kills = cgroup_figures(cap, cg)
    text = (out.parent / f"{out.name}.log").read_text(errors="replace")
    done = len(re.findall(r"step \d+ done:", text))
    run = Run(label, rc, rc in (-9, 137), done, usage.ru_maxrss * 1024, peak, kills, wall,
              anon.peak, anon.setup_peak)
    if rc == 0:
        run.report = json.loads((out / "report.json").read_text())
    if (rc == 0 or done == ns.steps) and (out / "LATEST").exists():
        # the steps' own records, saved after the last step: also there when the run was
        # killed afterwards, in the report's pass over the longest batch without the pieces
        # (the defaults show the planner's prediction instead where it could pass the
        # target; --target none has no target and runs it), so both sides of a cost pair
        # time the same steps
        latest = (out / (out / "LATEST").read_text().strip()) / "trainer_state.pt"
        run.history = torch.load(latest, weights_only=False)["history"]
    print(f"   {label}: {run.outcome}, {done} steps, {wall:.0f} s, RSS peak "
          f"{run.maxrss / MiB:.0f} MiB, cgroup peak "
          f"{(peak or 0) / MiB:.0f} MiB", flush=True)
    return run


class AnonPeak:
    """Samples a cgroup's anonymous memory every 20 ms (``memory.stat``: v1 ``rss``, v2
    ``anon``): the charge the kernel cannot reclaim, unlike page cache (the model file, the
    spill file), so what a cap must sit below for the kernel to kill. Training steps only:
    sampling stops when the log shows the last step done (the report's own passes after it
    run the longest batch without the pieces)."""

    def __init__(self, cap: Cap, cg: Path | None, log: Path, last: str) -> None:
        self.peak: int | None = None  # over the training steps
        self.setup_peak: int | None = None  # before them (load, quantize, the plan's profile)
        self._log, self._last = log, last
        self._done = threading.Event()
        self._key = "anon" if cap.kind == "cgroup-v2" else "rss"
        self._thread = None
        if cg is not None:
            self._stat = cg / "memory.stat"
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        n, training = 0, False
        while not self._done.wait(0.02):
            n += 1
            if n % 10 == 0:  # the setup ends with the "pressure:" line
                text = self._log.read_text(errors="replace")
                if self._last in text:
                    return
                training = training or "pressure:" in text
            try:
                for line in self._stat.read_text().splitlines():
                    k, v = line.split()
                    if k == self._key:
                        if training:
                            self.peak = max(self.peak or 0, int(v))
                        else:
                            self.setup_peak = max(self.setup_peak or 0, int(v))
                        break
            except (OSError, ValueError):
                return

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------------------- figures
def step_seconds(run: Run) -> list[float]:
    """Seconds of each step after the first (the first lays the state out)."""
    return [h["seconds"] for h in run.history[1:]]


def pressure_share(run: Run) -> float:
    """Time on pressure over step time: the pager's (reads before a step, evictions,
    restores, writing streamed pages back) plus the watch hooks' own (``watch_seconds``
    leaves out the evictions a hook asked for: the pager's time has them)."""
    paging = run.report.get("paging", {})
    total = sum(h["seconds"] for h in run.history)
    spent = paging.get("pressure_seconds", 0.0) + paging.get("watch_seconds", 0.0)
    return spent / total if total else float("nan")


def same_adapter(a: Path, b: Path) -> bool:
    x = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    y = load_file(str(b / "adapter" / "adapter_model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------- report
def write_report(ns: argparse.Namespace, cap: Cap, runs: dict[str, Run], **k: object) -> str:
    """The results file: setup, calibration, the capped runs, the fraction sweep, the cost."""
    mib = lambda n: "—" if n is None else f"{n / MiB:,.0f}"  # noqa: E731
    lines = [
        "# `tightfit train` under a memory cap: spikes from a few long examples",
        "",
        f"Command: `.venv/bin/python benchmarks/spike_cli.py{_args_text()}` "
        f"(commit {k['commit']})",
        "",
        f"- machine: {k['machine']} (shared with other work: compare ratios and the in-run "
        "shares, not absolute times)",
        f"- versions: {k['versions']}",
        f"- cap: **{cap.kind}** — {cap.detail}",
        f"- model: Llama, {ns.layers} layers, hidden {ns.hidden}, {ns.heads} heads, byte "
        f"vocabulary, random weights; LoRA r={ns.lora_r} on every linear layer (a large "
        f"optimizer state on purpose: {mib(k['state'])} MiB)",
        f"- data: {ns.examples} short text records (40-90 bytes) and {ns.long_examples} long "
        f"ones ({ns.long} bytes) at random places; `--batching bucket`, batch 2, "
        f"`--seq-len {ns.long}`, {ns.steps} steps (a long batch at steps "
        f"{', '.join(map(str, k['long_steps']))}), one thread; every run is "
        "`python -m tightfit -v train --model M --data D --format text ...` in its own process",
        "",
        "## Calibration (no cap, `--target none`)",
        "",
        f"Training RSS peak {mib(k['rss_train'])} MiB (the step records' high-water mark; the "
        f"report measured afterwards is not counted); the cgroup's anonymous memory peaked at "
        f"{mib(k['charge'])} MiB (sampled every 20 ms from `memory.stat`; the rest of its "
        f"{mib(k['cgroup_peak'])} MiB charge is page cache, which the kernel reclaims before "
        "it kills, and RSS also counts library pages other processes brought into the cache). "
        f"Before the first step it peaked at {mib(k['setup_peak'])} MiB (the planner profiles "
        "the longest batch without checkpointing). Cap = training steps' anonymous peak - "
        f"state/4 = **{mib(k['cap_bytes'])} MiB**. (Earlier tries: a cap from RSS, 1,013 MiB, "
        "let `--target none` complete; the anonymous peak of the whole run less state/2, "
        "861 MiB, killed both runs in the setup, before any optimizer state existed.)",
        "",
        "## Under the cap",
        "",
        "| run | outcome | steps | RSS peak (MiB) | anonymous peak (MiB) | cgroup peak (MiB) | "
        "OOM kills | evictions | restores | time on pressure |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    capped = [("calib", "`--target none`, no cap [calibration]"),
              ("none_capped", "`--target none`"), ("auto_capped", "defaults (`--target auto`)")]
    capped += [(key, f"`--target {key.split()[1]}`") for key in runs if key.startswith("frac")]
    for key, name in capped:
        r = runs[key]
        pg = r.report.get("paging", {})
        share = f"{100 * pressure_share(r):.1f} %" if r.report else "—"
        lines.append(f"| {name} | {r.outcome} | {r.steps_done} | {mib(r.maxrss)} | "
                     f"{mib(r.anon_peak)} | {mib(r.cgroup_peak)} | {r.oom_kills} | {pg.get('evictions', '—')} | "
                     f"{pg.get('restores', '—')} | {share} |")
    same = k["same"]
    lines += ["", "Adapter of the capped default run vs the uncapped calibration run: "
              + ("**bit-identical**" if same else "DIFFERENT" if same is False else
                 "not compared (the capped run did not complete)") + ".", ""]
    lines += _cost_lines(runs, mib(k["roomy"]))
    return "\n".join(lines) + "\n"


def _args_text() -> str:
    """This run's command-line options but ``--out`` (where the file went), for the header."""
    args, out = sys.argv[1:], []
    skip = False
    for a in args:
        if skip or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        out.append(a)
    return "".join(f" {a}" for a in out)


def _cost_lines(runs: dict[str, Run], roomy: str) -> list[str]:
    lines = ["## Cost: the defaults against `--target none`", "",
             f"Both in a cgroup of {roomy} MiB (room for `--target none`; the default target is "
             "0.9 of it, which the spikes pass). Runs alternate; median step time over the "
             "steps after the first, of all repeats; the share is the run's own time on "
             "pressure (the pager's probe reads, evictions, restores, writing streamed pages "
             "back, plus the watch's hooks' own time, less the evictions they asked for, "
             "which the pager's time already has) over its step time, measured inside it. On a "
             "shared machine the step-time ratio carries the other processes' noise; the "
             "share does not. Step times are the runs' own step records (saved after the last "
             "step, so also there for a run killed after it, in the report's pass over the "
             "longest batch without the pieces).", "",
             "| data | `--target none`: median step (s) | defaults: median step (s) | ratio | "
             "defaults: time on pressure | evictions | watch reads |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in ("short", "spike"):
        auto = [r for key, r in runs.items() if key.startswith(f"cost {kind} auto")]
        none = [r for key, r in runs.items() if key.startswith(f"cost {kind} none")]
        if not auto or not none or any(r.returncode for r in auto) or any(
                len(r.history) < r.steps_done or not r.history for r in none):
            lines.append(f"| {kind} | (a run failed: see the logs) | | | | | |")
            continue
        a = _median([s for r in auto for s in step_seconds(r)])
        n = _median([s for r in none for s in step_seconds(r)])
        shares = [pressure_share(r) for r in auto]
        ev = [r.report["paging"].get("evictions", 0) for r in auto]
        reads = [r.report["paging"].get("watch_reads", 0) for r in auto]
        name = "short examples only (no spike)" if kind == "short" else "a few long examples"
        ends = {r.outcome for r in none}
        if ends != {"completed"}:
            name += f" (`--target none`: {', '.join(sorted(ends))}, in the report's pass)"
        lines.append(f"| {name} | {n:.3f} | {a:.3f} | {a / n:.3f} | "
                     f"{100 * _median(shares):.2f} % | {_median(ev):.0f} | "
                     f"{_median(reads):.0f} |")
    return lines + [""]


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and runs (smoke run)")
    ap.add_argument("--out", default=str(HERE / "results" / "spike_cli.md"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lora-r", type=int, default=1024)
    ap.add_argument("--long", type=int, default=640, help="tokens of a long example")
    ap.add_argument("--examples", type=int, default=56, help="short examples")
    ap.add_argument("--long-examples", type=int, default=8)
    ap.add_argument("--fractions", default="0.95")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side of a cost pair")
    ns = ap.parse_args()
    if ns.quick:
        ns.steps, ns.repeats, ns.fractions = 8, 1, "0.95"
        if ns.out == str(HERE / "results" / "spike_cli.md"):
            ns.out = str(Path(tempfile.gettempdir()) / "spike_cli-quick.md")
    load = os.getloadavg()
    cap = detect_cap()
    print(f"cap: {cap.kind} ({cap.detail})", flush=True)
    if not cap.kind.startswith("cgroup"):
        print("this benchmark needs a writable memory cgroup (v1 or v2)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="tightfit-spike-cli-"))
    model, spiky, short = make_inputs(work, ns)
    runs: dict[str, Run] = {}

    print("1 calibration: --target none, no cap", flush=True)
    runs["calib"] = train("calibration", work / "calib", model, spiky, ns, cap, None,
                          ("--target", "none"))
    if runs["calib"].returncode != 0:
        print("calibration failed; see its log", file=sys.stderr)
        return 1
    hist = runs["calib"].history
    long_steps = [h["step"] for h in hist if h["longest"] > ns.long // 2]
    print(f"   steps with a long batch: {long_steps}", flush=True)
    if not long_steps:
        print("no long batch in these steps: raise --steps or --long-examples", file=sys.stderr)
        return 1
    state = runs["calib"].report["pieces"][-1]["with_bytes"]
    rss_train = max(h["host_rss_peak"] for h in hist)  # training steps only, not the report
    offset = runs["calib"].maxrss - (runs["calib"].cgroup_peak or runs["calib"].maxrss)
    # the cap: the training peak's charge less half the optimizer state. RSS counts shared
    # pages the cgroup does not charge (offset > 0: take them off); the cgroup also charges
    # page cache (the model file, the spill file), which it reclaims before it kills, so a
    # negative offset is not room the run can count on (measured: a cap that included it
    # let --target none complete with the charge at the cap)
    # measured: a cap from RSS (1,013 MiB, under RSS's peak of 1,081) let --target none
    # complete; RSS also counts file pages (torch's libraries) that other processes brought
    # into the cache. The sampled anonymous peak is the charge that must fit.
    # Measured next: a cap of the anonymous peak less state/2 (861 MiB) killed both runs in
    # the setup (the planner profiles the longest batch unchecked, before any optimizer
    # state exists), so the cap sits a quarter of the state under the training steps' peak,
    # and must stay above the setup's.
    charge = runs["calib"].anon_peak or rss_train - max(offset, 0)
    cap_bytes = charge - state // 4
    setup_peak = runs["calib"].setup_anon_peak or 0
    print(f"   setup's anonymous peak {setup_peak / MiB:.0f} MiB", flush=True)
    print(f"   state {state / MiB:.0f} MiB, training RSS peak {rss_train / MiB:.0f} MiB, "
          f"anonymous peak {charge / MiB:.0f} MiB -> cap {cap_bytes / MiB:.0f} MiB", flush=True)

    print("2 under the cap", flush=True)
    runs["none_capped"] = train("--target none, capped", work / "none_capped", model, spiky,
                                ns, cap, cap_bytes, ("--target", "none"))
    runs["auto_capped"] = train("defaults, capped", work / "auto_capped", model, spiky, ns,
                                cap, cap_bytes)
    print("3 the default's fraction, under the cap", flush=True)
    for f in filter(None, ns.fractions.split(",")):
        runs[f"frac {f}"] = train(f"--target {f}, capped", work / f"frac_{f}", model, spiky, ns,
                                  cap, cap_bytes, ("--target", f))

    print("4 cost: defaults vs --target none, both finishing", flush=True)
    roomy = charge + 64 * MiB  # --target none fits; 0.9 of it is passed by spikes
    for i in range(ns.repeats):
        for side, extra in (("auto", ()), ("none", ("--target", "none"))):
            for data, kind in ((spiky, "spike"), (short, "short")):
                key = f"cost {kind} {side} {i}"
                runs[key] = train(key, work / key.replace(" ", "_"), model, data, ns, cap,
                                  roomy, extra)
    text = write_report(ns, cap, runs, state=state, rss_train=rss_train, charge=charge,
                        setup_peak=setup_peak,
                        cgroup_peak=runs["calib"].cgroup_peak,
                        cap_bytes=cap_bytes, roomy=roomy,
                        same=same_adapter(work / "auto_capped", work / "calib")
                        if runs["auto_capped"].returncode == 0 else None,
                        long_steps=long_steps,
                        machine=f"{cpu_model()}, {os.cpu_count()} cores; load average at "
                                f"start {load_text(load)}, at the end "
                                f"{load_text(os.getloadavg())}", versions=versions_text(),
                        commit=git_commit())
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"inputs and logs kept in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
