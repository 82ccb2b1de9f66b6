"""Long context under a real memory cgroup: `tightfit train` with defaults vs the HF stack.

One command, every run a child process in a fresh memory cgroup (``benchmarks/spike.py``'s
helpers) of ``--cap`` bytes for the whole process:

1. the preflight's prediction: ``tightfit train --seq-len <positions>`` under the cap (the
   planner on the cgroup's limit refuses it before reading data, naming "the longest that
   fits these options: N tokens");
2. HF's longest: the ``hf`` stack of ``benchmarks/long_context.py`` (bitsandbytes 4-bit + peft
   + ``prepare_model_for_kbit_training`` + transformers' own offload of checkpointed inputs,
   SDPA), ``--steps`` training steps, bisected between ``--hf-lo`` and ``--hf-hi``;
3. tightfit's longest: ``tightfit train --model DIR --tokenizer bytes --data FILE --seq-len N
   --batch-size 1 --steps S`` (defaults only, the CLI as a user runs it) at fractions of the
   prediction, and once just past it (the preflight refuses it);
4. the losses of the longest capped run beside the same command uncapped (a cgroup without a
   limit);
5. step time at HF's longest, paired: HF then tightfit, ``--pairs`` times, uncapped.

While a child runs, its cgroup's ``memory.usage_in_bytes`` and ``memory.stat`` are sampled
(``--sample-s``): a killed run leaves the charge it reached and what the charge was (anon,
page cache, mapped files). Run: ``.venv/bin/python benchmarks/long_context_cli.py`` (writes
``benchmarks/results/long_context_cgroup.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
LONGEST = re.compile(r"longest (?:that fits these options|sequence these options fit)"
                     r"(?: is|:) ([\d,]+) tokens")
STEP = re.compile(r"step (\d+) done: loss ([\d.]+), ([\d.]+) s")


class Sampler(threading.Thread):
    """The cgroup's charge every ``period`` seconds: its peak and ``memory.stat`` there."""

    def __init__(self, cg: Path | None, period: float):
        super().__init__(daemon=True)
        self.cg, self.period, self.stop = cg, period, threading.Event()
        self.peak, self.at_peak, self.samples = 0, {}, 0

    def run(self) -> None:
        use = self.cg / "memory.usage_in_bytes" if self.cg else None
        while self.cg is not None and not self.stop.is_set():
            try:
                now = int(use.read_text())
                if now >= self.peak:
                    stat = (self.cg / "memory.stat").read_text().split("\n")
                    keep = ("total_rss", "total_cache", "total_mapped_file", "total_shmem",
                            "total_dirty", "total_writeback")
                    self.peak = now
                    self.at_peak = {k: int(v) >> 20 for k, v in
                                    (x.split() for x in stat if x) if k in keep}
                self.samples += 1
            except (OSError, ValueError):
                pass
            self.stop.wait(self.period)


def capped(cmd: list[str], cap: int | None, a: argparse.Namespace, log: Path) -> dict:
    """Run ``cmd`` in a fresh cgroup (limit ``cap``, none when ``None``); what it left."""
    from spike import cgroup_figures, child_cgroup, detect_cap

    cap_kind = detect_cap()
    if cap is not None and not cap_kind.kind.startswith("cgroup"):
        raise SystemExit(f"no memory cgroup to cap a run at {cap >> 20} MiB: {cap_kind.detail}")
    cg, preexec = child_cgroup(cap_kind, cap, "tightfit-lccli")
    sampler = Sampler(cg if cap_kind.kind == "cgroup-v1" else None, a.sample_s)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, preexec_fn=preexec, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
        sampler.start()
        _, status, _ = os.wait4(proc.pid, 0)
    sampler.stop.set()
    sampler.join()
    rc = os.waitstatus_to_exitcode(status)
    peak, oom = cgroup_figures(cap_kind, cg)
    text = log.read_text(errors="replace")
    return {"rc": rc, "killed": rc in (-9, 137), "oom_kills": oom, "cap": cap,
            "cap_kind": cap_kind.kind, "cgroup_peak": peak, "sampled_peak_mib": sampler.peak >> 20,
            "stat_at_peak_mib": sampler.at_peak, "wall_s": round(time.perf_counter() - t0, 1),
            "text": text}


def train_cmd(a: argparse.Namespace, folder: Path, data: Path, tokens: int, out: Path) -> list:
    """``tightfit train`` with defaults only (-v: each step's loss and seconds)."""
    return [sys.executable, "-m", "tightfit.cli", "train", "--model", str(folder),
            "--tokenizer", "bytes", "--data", str(data), "--seq-len", str(tokens),
            "--batch-size", "1", "--steps", str(a.steps), "--out", str(out), "-v"]


def tightfit_run(a: argparse.Namespace, tmp: Path, tokens: int, cap: int | None) -> dict:
    folder, data = tmp / "model", tmp / "data.txt"
    name = f"tf-{tokens}-{'cap' if cap else 'free'}-{time.monotonic_ns()}"
    r = capped(train_cmd(a, folder, data, tokens, tmp / name), cap, a, tmp / f"{name}.log")
    text = " ".join(r.pop("text").split())
    m = LONGEST.search(text)
    steps = [(int(i), float(loss), float(s)) for i, loss, s in STEP.findall(text)]
    refused = "refused" in text.lower() or ("error" in text.lower() and not steps)
    r.update(stack="tightfit", tokens=tokens, predicted=int(m[1].replace(",", "")) if m else None,
             losses=[x[1] for x in steps], seconds=[x[2] for x in steps],
             ok=r["rc"] == 0 and len(steps) == a.steps, refused=refused and r["rc"] != 0,
             tail=text[-600:] if r["rc"] != 0 else "")
    print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
    return r


def hf_run(a: argparse.Namespace, tmp: Path, tokens: int, cap: int | None) -> dict:
    """``benchmarks/long_context.py --child hf``: the HF stack, ``a.steps`` steps."""
    folder = tmp / "model"
    log = tmp / f"hf-{tokens}-{time.monotonic_ns()}.jsonl"
    args = ["--folder", str(folder), "--cgroup-tokens", str(tokens),
            "--cgroup-steps", str(a.steps), "--log", str(log)]
    for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "positions",
              "r", "threads"):
        args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    cmd = [sys.executable, str(HERE / "long_context.py"), "--child", "hf", *args]
    r = capped(cmd, cap, a, tmp / f"{log.name}.out")
    r.pop("text")
    recs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    steps = [x for x in recs if "loss" in x]
    r.update(stack="hf", tokens=tokens, losses=[x["loss"] for x in steps],
             seconds=[x["seconds"] for x in steps], ok=r["rc"] == 0 and len(steps) == a.steps)
    print(json.dumps(r), flush=True)
    return r


def make_inputs(a: argparse.Namespace, tmp: Path) -> None:
    """The model (long_context.py's Llama-architecture builder) and the text: the standard
    library's own sources in sorted order, so every machine with this Python has it."""
    sys.argv = sys.argv[:1]
    import long_context as lc

    lc.save_model(tmp / "model", a)
    import sysconfig

    parts, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(f.read_text(errors="replace"))
        size += len(parts[-1])
        if size > a.data_bytes:
            break
    (tmp / "data.txt").write_text("".join(parts)[: a.data_bytes])


def bisect_hf(a: argparse.Namespace, tmp: Path, runs: list) -> int:
    lo, hi = a.hf_lo, a.hf_hi
    for _ in range(a.hf_probes):
        if hi - lo <= a.hf_resolution:
            break
        mid = (lo + hi) // 2
        r = hf_run(a, tmp, mid, a.cap)
        runs.append(r)
        lo, hi = (mid, hi) if r["ok"] else (lo, mid)
    return lo


def search_tightfit(a: argparse.Namespace, tmp: Path, runs: list, free: dict) -> tuple:
    """The preflight's prediction, then runs at ``a.fractions`` of it (capped) beside the
    prediction's length uncapped (its losses), two children at a time (the machine is shared:
    wall time, not any timing, is what runs in parallel)."""
    first = tightfit_run(a, tmp, a.positions, a.cap)
    runs.append(first)
    pred = first["predicted"]
    if not pred:
        return None, 0
    lengths = [int(pred * f) for f in a.fractions]
    both = threading.Thread(target=lambda: free.__setitem__(
        "tightfit", tightfit_run(a, tmp, pred, None)))
    both.start()
    found = [tightfit_run(a, tmp, n, a.cap) for n in lengths]
    last = found[-1]
    if last["refused"] and last["predicted"] and last["predicted"] < last["tokens"]:
        # each run's preflight measures its own RSS: a few MiB more and the prediction moves
        # by ~1 %, so a run at the first prediction may be refused; once more at 99 % of its own
        both.join()
        runs.append(free["tightfit"])
        n = int(last["predicted"] * 0.99)
        both = threading.Thread(target=lambda: free.__setitem__(
            "tightfit", tightfit_run(a, tmp, n, None)))  # its losses at the same length
        both.start()
        found.append(tightfit_run(a, tmp, n, a.cap))
    both.join()
    runs += [*found, free["tightfit"]]
    return pred, max((r["tokens"] for r in found if r["ok"]), default=0)  # free: at pred


def hf_side(a: argparse.Namespace, tmp: Path, runs: list, pairs: list, after: threading.Event,
            longest: list) -> None:
    """HF's longest under the cap, then (once tightfit's capped runs are done) the pairs."""
    r = hf_run(a, tmp, a.hf_lo, a.cap)
    runs.append(r)
    longest.append(bisect_hf(a, tmp, runs) if r["ok"] else 0)
    after.wait(0)  # the pairs start at once: each pair sees the same load
    for _ in range(a.pairs if longest[0] else 0):  # paired: HF then tightfit, uncapped
        h, f = hf_run(a, tmp, longest[0], None), tightfit_run(a, tmp, longest[0], None)
        runs += [h, f]
        pairs.append((h, f))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=448)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--positions", type=int, default=131_072)
    p.add_argument("--r", type=int, default=16, help="HF's LoRA rank (tightfit's default: 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cap", type=int, default=725 * MiB, help="the cgroup's limit, bytes")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--hf-lo", type=int, default=128)
    p.add_argument("--hf-hi", type=int, default=2048)
    p.add_argument("--hf-probes", type=int, default=5)
    p.add_argument("--hf-resolution", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="*", default=[1.1, 1.0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--data-bytes", type=int, default=600_000)
    p.add_argument("--sample-s", type=float, default=0.25)
    p.add_argument("--out", default=str(HERE / "results" / "long_context_cgroup.md"))
    p.add_argument("--raw", default=str(HERE / "results" / "long_context_cgroup.json"))
    p.add_argument("--from-json", default=None, help="rewrite --out from a --raw file")
    p.add_argument("--pairs-at", type=int, default=None,
                   help="only the step-time pairs at this many tokens (one after the other, "
                        "nothing else running), written into the --raw file's records")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        write(res, Path(a.out))
        return res
    if a.pairs_at:
        return pairs_only(a)
    load0, t0 = os.getloadavg(), time.perf_counter()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        make_inputs(a, tmp)
        free: dict = {}
        pairs: list = []
        hf_runs: list = []
        done, hf_longest = threading.Event(), []
        side = threading.Thread(target=hf_side, args=(a, tmp, hf_runs, pairs, done, hf_longest))
        side.start()
        pred, tf_longest = search_tightfit(a, tmp, runs, free)
        done.set()
        side.join()
        runs += hf_runs
        hf_longest = hf_longest[0]
    res = {"args": vars(a), "predicted": pred, "tf_longest": tf_longest,
           "hf_longest": hf_longest, "runs": runs, "free": free, "pairs": pairs,
           "load": (load0, os.getloadavg()), "wall_s": time.perf_counter() - t0}
    Path(a.raw).write_text(json.dumps(res, indent=1, default=str))
    write(res, Path(a.out))
    return res


def pairs_only(a: argparse.Namespace) -> dict:
    """``--pairs`` pairs at ``--pairs-at`` tokens, HF then tightfit, uncapped, alone on the
    machine; they replace the pairs of the ``--raw`` file, which is then written out again."""
    res = json.loads(Path(a.raw).read_text())
    load0 = os.getloadavg()
    pairs = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        make_inputs(a, tmp)
        for _ in range(a.pairs):
            pairs.append((hf_run(a, tmp, a.pairs_at, None), tightfit_run(a, tmp, a.pairs_at, None)))
    res.update(pairs=pairs, pairs_load=(load0, os.getloadavg()), pairs_at=a.pairs_at)
    Path(a.raw).write_text(json.dumps(res, indent=1, default=str))
    write(res, Path(a.out))
    return res


def write(r: dict, out: Path) -> None:
    from environment import cpu_model, load_text, versions_text

    a = r["args"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    hf, tf, pred = r["hf_longest"], r["tf_longest"], r["predicted"]
    lines = [
        "# Long context under a real memory cgroup: `tightfit train` (defaults) vs HF + offload",
        "",
        f"Model: Llama architecture from a config (random weights), hidden {a['hidden']}, "
        f"intermediate {a['intermediate']}, {a['layers']} layers, {a['heads']} heads / "
        f"{a['kv_heads']} KV heads, vocabulary {a['vocab']:,}, {a['positions']:,} positions; "
        f"batch 1, {a['steps']} training steps a run. Cap: **{a['cap'] / MiB:.0f} MiB** for "
        "the whole process (a fresh cgroup-v1 memory cgroup per run).",
        f"Machine: {cpu_model()}, {a['threads']} torch threads; load average before / after "
        f"{load_text(r['load'][0])} → {load_text(r['load'][1])}. {versions_text()}; commit "
        f"{commit}. Wall time {r['wall_s'] / 60:.1f} min.",
        "", "Run: `.venv/bin/python benchmarks/long_context_cli.py` (raw records: "
        "long_context_cgroup.json).", "",
        f"- preflight prediction (the planner on the cgroup's limit): **{pred or 0:,} tokens**",
        f"- tightfit train, defaults, longest trained under the cap: **{tf:,} tokens**"
        + (f" ({(tf - pred) / pred:+.1%} of the prediction)" if pred and tf else ""),
        f"- HF stack with its offload, longest trained under the cap: **{hf:,} tokens**",
        f"- tightfit / HF: **{tf / hf:.1f}×**" if hf and tf else "- tightfit / HF: —",
        "", "| stack | tokens | cap MiB | exit | OOM kills | cgroup peak MiB | steps | losses | "
        "step s | note |", "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for x in r["runs"]:
        cap = "none" if x["cap"] is None else f"{x['cap'] / MiB:.0f}"
        peak = "—" if x["cgroup_peak"] is None else f"{x['cgroup_peak'] / MiB:.0f}"
        note = ("refused by the preflight" if x.get("refused") else
                f"killed; charge at peak {x['stat_at_peak_mib']}" if x["killed"] else "")
        if x.get("predicted"):
            note += f" predicted longest {x['predicted']:,}"
        lines.append(f"| {x['stack']} | {x['tokens']:,} | {cap} | {x['rc']} | {x['oom_kills']} | "
                     f"{peak} | {len(x['losses'])} | {', '.join(f'{v:.4f}' for v in x['losses'])}"
                     f" | {', '.join(f'{v:.1f}' for v in x['seconds'])} | {note} |")
    free = r["free"].get("tightfit")
    same = next((x for x in r["runs"] if x["stack"] == "tightfit" and x["cap"] is not None
                 and free and x["tokens"] == free["tokens"] and x["ok"]), None)
    if free and same:
        eq = "equal" if same["losses"] == free["losses"] else "NOT equal"
        lines += ["", f"Losses at {free['tokens']:,} tokens, capped vs uncapped (the same "
                  f"command, a cgroup without a limit): {same['losses']} vs {free['losses']}: "
                  f"**{eq}** (as printed by -v, 4 decimals)."]
    if r["pairs"]:
        ratios = [f["seconds"][-1] / h["seconds"][-1] for h, f in r["pairs"]
                  if f["seconds"] and h["seconds"]]
        at = r.get("pairs_at", hf)
        alone = (f" Run alone afterwards (`--pairs-at {at} --pairs {len(r['pairs'])}`), load "
                 f"{load_text(r['pairs_load'][0])} → {load_text(r['pairs_load'][1])}."
                 if "pairs_load" in r else " Run beside the other runs of this command.")
        lines += ["", f"Step time at HF's longest ({at:,} tokens), uncapped, paired (HF then "
                  "tightfit, the last step of each run; tightfit's includes its optimizer "
                  f"step): tightfit / HF per pair {', '.join(f'{x:.2f}' for x in ratios)}; "
                  f"median **{statistics.median(ratios):.2f}×**.{alone}" if ratios else ""]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
