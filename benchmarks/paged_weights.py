"""Paged base weights on the CPU: the step's peak memory and time, all weights resident vs paged.

A Llama-shaped model (hidden 1024, intermediate 2816, 8 layers, 16/4 heads, vocab 4096,
~5.7 MB of NF4 weights a layer) is prepared with tightfit's QLoRA stack (NF4 + DQ, LoRA r=16,
``checkpoint="every"``, chunked loss) and trained on batches of 1 x 256 tokens, in a child
process per run inside its own memory cgroup (``benchmarks/spike.py``'s helpers), with
``MALLOC_MMAP_THRESHOLD_=65536`` in both (glibc then returns every freed buffer of 64 KiB or
more to the OS at once, so RSS follows what is live in both configurations alike):

* ``resident``: ``resident_layers="all"`` (nothing pages);
* ``paged``: ``resident_layers=1`` — the other 7 layers' 4-bit weights live in a spill file
  and stream in one layer ahead (``tightfit.qlora.paged_base``).

Each child resets its high-water marks once the model is prepared (the fp32 weights of the
unquantized model are gone by then): the cgroup's ``memory.max_usage_in_bytes`` (RSS + page
cache) and the process's ``VmHWM`` (``/proc/self/clear_refs``), so the peaks are the steps'.
Runs alternate (resident, paged, resident, paged, ...) and the step times are compared as
paired ratios from the same run. The page cache of the spill file is charged to the cgroup
but reclaimable; the last part of the run proves the saving under a real limit: both
configurations under one cap (set by the child on its own cgroup once the model is prepared,
so it bounds the steps, not the fp32 model built before quantization) — the resident run is
expected to be OOM-killed, the paged one to finish with the same losses.

Beside the CPU figures: the planner's estimate of the link cost on a GPU (20 GB/s, 100
TFLOP/s: ``tightfit.planner.paged_weights.exposed_seconds``) for this shape and for
Llama-3.1-8B, all layers streamed. Writes ``benchmarks/results/paged_weights.md``.

Usage::

    .venv/bin/python benchmarks/paged_weights.py            # ~5 min on 2 shared cores
    .venv/bin/python benchmarks/paged_weights.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from environment import cpu_model, git_commit, load_text, versions_text
from spike import cgroup_figures, child_cgroup, detect_cap

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 2**20
CONFIG = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "max_position_embeddings": 1024,
          "tie_word_embeddings": False}
SEQ = 256


# ----------------------------------------------------------------------------- the child
def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _own_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            return path if (path / "memory.max_usage_in_bytes").exists() else None
    return None


def child(ns: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tightfit
    from tightfit.qlora.paged_base import paged_base_of

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    resident = "all" if ns.resident == "all" else int(ns.resident)
    model = tightfit.prepare(LlamaForCausalLM(cfg), checkpoint="every", loss_chunks=128,
                             mlp_tile=None, resident_layers=resident, lora={"r": 16})
    opt = tightfit.optimizer_for(model, kind="adamw", lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=gen)
               for _ in range(ns.steps)]
    import ctypes
    ctypes.CDLL(None).malloc_trim(0)  # the fp32 init's freed heap leaves before the reset
    cg = _own_cgroup()
    if cg is not None:
        (cg / "memory.max_usage_in_bytes").write_text("0")
        if ns.limit:  # the cap is the steps': preparing (the fp32 model first) needs more
            (cg / "memory.limit_in_bytes").write_text(str(ns.limit))
            memsw = cg / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(ns.limit))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    records = []
    for x in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        records.append({"loss": loss.item(), "s": time.perf_counter() - t0})
    pager = paged_base_of(model)
    out = {"records": records, "hwm": _vm_hwm(),
           "cg_peak": int((cg / "memory.max_usage_in_bytes").read_text()) if cg else None,
           "streamed": pager.streamed_bytes if pager else 0,
           "loads": pager.loads if pager else 0, "blocked_s": pager.blocked_s if pager else 0}
    Path(ns.out).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- the parent
def run(cap, resident: str, steps: int, limit: int | None, log: Path) -> dict:  # noqa: ANN001
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--resident", resident,
           "--steps", str(steps), "--out", str(log), "--limit", str(limit or 0)]
    log.unlink(missing_ok=True)
    cg, join = child_cgroup(cap, None, "tightfit-paged")  # the child sets its limit
    t0 = time.perf_counter()
    with open(log.with_suffix(".err"), "w") as err:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.Popen(cmd, preexec_fn=join, cwd=ROOT, stderr=err, env=env)
        _, status, _ = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0 and limit is None:
        print(log.with_suffix(".err").read_text()[-2000:], file=sys.stderr)
    _, kills = cgroup_figures(cap, cg)
    res = json.loads(log.read_text()) if rc == 0 and log.exists() else {}
    return {"rc": rc, "oom_kills": kills, "wall": time.perf_counter() - t0, **res}


def planner_lines() -> list[str]:
    from tightfit.planner.estimate import estimate
    from tightfit.planner.paged_weights import exposed_seconds, weight_placement
    from tightfit.planner.presets import load_shape
    from tightfit.planner.speed import step_seconds
    from tightfit.planner.train_setup import TrainSetup

    lines = ["| shape | tokens | streamed | moved a step | link time not hidden | plain step "
             "compute | exposed / step |", "|---|---|---|---|---|---|---|"]
    for name, shape, tokens in (("this benchmark's", load_shape(CONFIG), SEQ),
                                ("llama-3.1-8b", load_shape("llama-3.1-8b"), 4096),
                                ("llama-3.1-8b", load_shape("llama-3.1-8b"), 100_000)):
        setup = TrainSetup(seq_len=tokens, checkpoint="every", loss_chunk_tokens=512,
                           offload="inputs", resident_layers=0)
        est = estimate(shape, setup)
        placed = weight_placement(shape, setup)
        exposed = exposed_seconds(shape, setup, est.segments, gpu_tflops=100, link_gbps=20)
        step = step_seconds(shape, setup, 100)
        lines.append(f"| {name} | {tokens:,} | {placed.streamed}/{shape.layers} layers | "
                     f"{placed.moved_per_step / MiB:,.0f} MiB | {1e3 * exposed:.2f} ms | "
                     f"{1e3 * step:.1f} ms | {100 * exposed / step:.2f} % |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--resident", default="all")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--limit", type=int, default=0, help="(child) memory limit of the steps")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reuse", help="a folder with the uncapped runs' outputs of an earlier "
                                    "invocation (paged-{all,1}-<i>.json): only the capped "
                                    "runs are made")
    ns = ap.parse_args()
    if ns.child:
        child(ns)
        return 0
    if ns.quick:
        ns.pairs, ns.steps = 1, 2
    cap = detect_cap()
    if not cap.kind.startswith("cgroup-v1"):
        print(f"needs a cgroup-v1 memory controller (found: {cap.detail})")
        return 1
    load0 = os.getloadavg()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    runs: dict[str, list[dict]] = {"all": [], "1": []}
    for i in range(ns.pairs):
        for resident in ("all", "1"):
            if ns.reuse:
                r = {"rc": 0, "oom_kills": 0, **json.loads(
                    (Path(ns.reuse) / f"paged-{resident}-{i}.json").read_text())}
            else:
                r = run(cap, resident, ns.steps, None, logs / f"paged-{resident}-{i}.json")
            print(resident, {k: v for k, v in r.items() if k != "records"}, flush=True)
            runs[resident].append(r)
    capped = _capped(cap, runs, ns.steps, logs)
    _write(ns, runs, capped, load0, os.getloadavg())
    return 0


def _capped(cap, runs: dict, steps: int, logs: Path) -> dict:  # noqa: ANN001
    """Both configurations under one limit: the resident run's cgroup peak less half the RSS
    the paged one saves (what the cgroup charges each: its own RSS and page cache)."""
    saved = statistics.median(r["hwm"] for r in runs["all"]) - statistics.median(
        r["hwm"] for r in runs["1"])
    limit = int(statistics.median(r["cg_peak"] for r in runs["all"]) - max(saved, 0) // 2)
    out = {"limit": limit}
    for resident in ("all", "1"):
        out[resident] = run(cap, resident, steps, limit, logs / f"paged-cap-{resident}.json")
        print("capped", resident, out[resident].get("rc"), flush=True)
    return out


def _write(ns, runs: dict, capped: dict, load0, load1) -> None:  # noqa: ANN001
    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    # per run: the median step after the first (warm-up) one
    for rs in runs.values():
        for r in rs:
            r["step"] = statistics.median(x["s"] for x in r["records"][1:])
    ratios = [p["step"] / a["step"] for a, p in zip(runs["all"], runs["1"])]
    losses_equal = all(a["records"] == p["records"] or
                       [x["loss"] for x in a["records"]] == [x["loss"] for x in p["records"]]
                       for a, p in zip(runs["all"], runs["1"]))
    a, p = runs["all"], runs["1"]
    streamed = p[0]["streamed"]
    lines = [
        "# Paged base weights (CPU)", "",
        "`benchmarks/paged_weights.py`: a Llama-shaped model (hidden 1024, intermediate 2816, "
        "8 layers, 16/4 heads, vocab 4096; NF4 + DQ, LoRA r=16 on all linears, "
        f"`checkpoint=\"every\"`, chunked loss), batches of 1 x {SEQ} tokens, {ns.steps} "
        "steps a run, each run a child process in its own memory cgroup; peaks reset once the "
        "model is prepared; `MALLOC_MMAP_THRESHOLD_=65536` in both. `resident`: `resident_layers=\"all\"`; `paged`: "
        f"`resident_layers=1` ({streamed / MiB:.1f} MiB of 4-bit weights in the spill file, "
        "7 of 8 layers streaming).", "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores shared with other work; "
        f"{versions_text()}; commit {git_commit()}; load before / after "
        f"{load_text(load0)} -> {load_text(load1)}. Step times are medians of steps 2..n "
        f"per run; the ratio is paired (run i paged / run i resident, alternating in one "
        "run of the script): absolute times are not comparable across machines.", "",
        "| | VmHWM (RSS peak) | cgroup peak (RSS + page cache) | step (median) |",
        "|---|---|---|---|",
        f"| resident | {med(a, 'hwm') / MiB:.1f} MiB | {med(a, 'cg_peak') / MiB:.1f} MiB | "
        f"{1e3 * med(a, 'step'):.0f} ms |",
        f"| paged (1 resident) | {med(p, 'hwm') / MiB:.1f} MiB | {med(p, 'cg_peak') / MiB:.1f}"
        f" MiB | {1e3 * med(p, 'step'):.0f} ms |", "",
        f"- RSS peak saved: {(med(a, 'hwm') - med(p, 'hwm')) / MiB:.1f} MiB (the model's "
        f"streamed weights less the two layers in flight: "
        f"{streamed * 5 / 7 / MiB:.1f} MiB expected).",
        f"- paired step-time ratio paged / resident: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}); the copy thread shares the 2 cores with "
        f"the compute, so nothing of a move is hidden here; compute blocked on copies: "
        f"{1e3 * med(p, 'blocked_s') / ns.steps:.0f} ms a step.",
        f"- losses equal, step by step: {'yes' if losses_equal else 'NO'}.",
        "- the cgroup peak counts the spill file's page cache (clean after each release, "
        "reclaimable); under a limit the kernel takes it back:", "",
        f"Under one memory limit of {capped['limit'] / MiB:.1f} MiB on the steps (set once the "
        "model is prepared; the resident run's cgroup peak less half the RSS paging saves" + (
            "; the uncapped runs above are reused from an earlier invocation, --reuse"
            if ns.reuse else "") + "):", "",
        "| | exit | OOM kills | losses |", "|---|---|---|---|",
    ]
    for resident, name in (("all", "resident"), ("1", "paged (1 resident)")):
        r = capped[resident]
        same = ("equal to the uncapped run" if r.get("records") and
                [x["loss"] for x in r["records"]] == [x["loss"] for x in runs[resident][0]
                                                       ["records"]] else "-")
        lines.append(f"| {name} | {r['rc']} | {r['oom_kills']} | {same} |")
    lines += ["", "The planner's estimate for a GPU (20 GB/s link, 100 TFLOP/s, every layer "
              "streamed, `checkpoint=every` with offloaded inputs): the link time that the "
              "compute beside each load does not hide, against the plain step's compute:", "",
              *planner_lines(), ""]
    (HERE / "results" / "paged_weights.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
