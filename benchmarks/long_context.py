"""Long context: the longest sequence one fixed budget trains, HF stack vs tightfit.

Three stacks on one small Llama-architecture model built from a config (Llama proportions:
intermediate 3.5 × hidden, GQA, a 32k vocabulary), NF4 + double quant + LoRA on all linears:

* **hf**: ``BitsAndBytesConfig`` 4-bit + ``prepare_model_for_kbit_training`` with
  ``gradient_checkpointing_enable(..., offload=True)`` (every layer, non-reentrant, its
  checkpointed inputs offloaded by transformers itself: :func:`hf_offload`) + peft LoRA, SDPA;
* **now**: ``tightfit.prepare(checkpoint="every", offload="none", mlp_tile="none")``: every
  layer checkpointed + chunked loss, as tightfit was before long-context planning;
* **long**: ``tightfit.prepare(checkpoint_budget=BUDGET)`` with the defaults
  (``offload="auto"``, ``mlp_tile="auto"``, ``loss_chunks="auto"``): the plan it chose.

The "device tier" is measured as the peak of live tensor bytes a forward + backward adds
(``MemoryTracker``: storages allocated and not yet freed; on CUDA ``max_memory_allocated``).
On the CPU the fixed budget is a **simulated** device budget (``--budget``): a sequence fits a
stack when its measured step peak is at most the budget. The longest fitting sequence is found
by measurement: doubling from ``--start``, then bisection to ``--resolution``. For **long** the
predicted longest is the longest sequence ``prepare`` plans within the budget (it refuses the
others), found the same way without running steps.

``--cgroup-tokens T`` adds the real-memory check: each stack runs ``--cgroup-steps`` steps at T
tokens in a child process under a memory cgroup of ``--cgroup-cap`` bytes (cgroup v1/v2, see
``benchmarks/spike.py``), and uncapped for the losses to compare.

Run: ``.venv/bin/python benchmarks/long_context.py`` (writes
``benchmarks/results/long_context.md``); ``--device cuda --hidden 4096 ...`` on a GPU (see
``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from environment import cpu_model, load_text, versions_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tightfit  # noqa: E402
from tightfit.measure.tracker import MemoryTracker  # noqa: E402

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
STACKS = ("hf", "now", "long")


def save_model(folder: Path, a: argparse.Namespace) -> None:
    """A random Llama-architecture model of ``a``'s shape, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                      intermediate_size=a.intermediate or a.hidden * 7 // 2,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, max_position_embeddings=a.positions,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    LlamaForCausalLM(cfg).save_pretrained(folder)


def build(stack: str, folder: Path, batch: dict, a: argparse.Namespace) -> torch.nn.Module:
    """The model of ``stack`` for ``batch`` (tightfit plans for it; HF does not look)."""
    lora = {"r": a.r, "alpha": 2 * a.r, "dropout": 0.0}
    torch.manual_seed(1)
    model = _build(stack, folder, batch, a, lora)
    model.train()  # from_pretrained returns eval mode: HF checkpointing and the chunked loss
    return model   # act in training only


def _build(stack: str, folder: Path, batch: dict, a: argparse.Namespace,
           lora: dict) -> torch.nn.Module:
    dev = torch.device(a.device)
    if stack == "now":
        return tightfit.prepare(folder, lora=lora, checkpoint="every", offload="none",
                                mlp_tile="none", example=batch, device=dev)
    if stack == "long":
        return tightfit.prepare(folder, lora=lora, checkpoint_budget=a.budget,
                                offload_dir=a.offload_dir, example=batch, device=dev)
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=dtype,
                                                 device_map=str(dev), attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_offload(model)
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=0.0,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))


def hf_offload(model: torch.nn.Module) -> None:
    """Turn on transformers' own offload of checkpointed inputs (transformers >= 5.17).

    In 5.23 ``offload`` is an argument of ``gradient_checkpointing_enable`` beside
    ``gradient_checkpointing_kwargs`` (``gradient_checkpointing_kwargs={"offload": True}`` is
    handed on to ``torch.utils.checkpoint`` and fails there: "Unexpected keyword arguments:
    offload"). It wraps each checkpointed layer in ``torch.autograd.graph.save_on_cpu(
    pin_memory=True)``; a CPU-only torch has no pinned allocator and raises on the first
    step, so on the CPU the same wrapper runs with ``pin_memory=False`` (the one change).
    There the saved tensors already live in host memory (``tensor.cpu()`` returns them as
    they are): HF's offload saves nothing on the CPU, and the baseline is HF as it runs there.
    """
    import transformers.modeling_utils as mu

    if not torch.cuda.is_available() and not getattr(mu.save_on_cpu, "_unpinned", False):
        def unpinned(pin_memory: bool = False, device_type: str = "cpu"):  # noqa: ANN202
            return torch.autograd.graph.save_on_cpu(pin_memory=False, device_type=device_type)
        unpinned._unpinned = True  # type: ignore[attr-defined]
        mu.save_on_cpu = unpinned
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                        offload=True)


def batch_of(tokens: int, a: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randint(0, a.vocab, (1, tokens), generator=g).to(a.device)
    return {"input_ids": x, "labels": x}


def step(model: torch.nn.Module, batch: dict, device: str) -> tuple[float, int, float]:
    """One forward + backward: (loss, peak bytes it added, seconds)."""
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        torch.cuda.synchronize()
        return float(loss), torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0
    t0 = time.perf_counter()
    with MemoryTracker("cpu") as mt:
        loss = model(**batch).loss
        loss.backward()
    return float(loss), mt.peak_bytes, time.perf_counter() - t0


class Probe:
    """Measured (and for **long** predicted) fits of one stack, sequence by sequence."""

    def __init__(self, stack: str, folder: Path, a: argparse.Namespace, log: list[dict]):
        self.stack, self.folder, self.a, self.log = stack, folder, a, log
        self.model: torch.nn.Module | None = None  # hf and now: one model for every length

    def _model(self, batch: dict) -> torch.nn.Module:
        if self.stack == "long":
            return build("long", self.folder, batch, self.a)  # its plan is per length
        if self.model is None:
            self.model = build(self.stack, self.folder, batch, self.a)
        return self.model

    def planned(self, tokens: int) -> bool:
        """**long** only: does prepare find a plan within the budget at ``tokens``?"""
        try:
            model = build("long", self.folder, batch_of(tokens, self.a), self.a)
        except ValueError:
            self.log.append({"stack": "long", "tokens": tokens, "planned": False})
            return False
        plan = model.tightfit_info.plan
        self.log.append({"stack": "long", "tokens": tokens, "planned": True,
                         "predicted": plan.predicted_peak_bytes})
        return True

    def fits(self, tokens: int) -> bool:
        """Does one measured step at ``tokens`` stay within the budget?"""
        batch = batch_of(tokens, self.a)
        rec: dict = {"stack": self.stack, "tokens": tokens}
        try:
            model = self._model(batch)
        except ValueError as e:  # long: no plan within the budget, so it does not fit
            rec.update(refused=str(e)[:200])
            self.log.append(rec)
            return False
        info = getattr(model, "tightfit_info", None)
        if info is not None and info.plan is not None:
            rec["plan"] = _plan_summary(info)
            if self.stack == "long":  # "now" keeps the plan made for its first length
                rec["predicted"] = info.plan.predicted_peak_bytes
        try:
            loss, peak, seconds = step(model, batch, self.a.device)
        except (MemoryError, RuntimeError) as e:  # a CUDA OOM: does not fit
            rec.update(error=str(e)[:200])
            self.log.append(rec)
            return False
        rec.update(loss=loss, peak=peak, seconds=seconds)
        self.log.append(rec)
        return peak <= self.a.budget


def _plan_summary(info: object) -> str:
    plan, tiling = info.plan, info.tiling  # type: ignore[attr-defined]
    kinds: dict[str, int] = {}
    for s in plan.segments:
        kinds[s.kind] = kinds.get(s.kind, 0) + s.stop - s.start
    parts = [f"{n} {k}" for k, n in kinds.items()]
    if tiling is not None:
        parts.append(f"MLP tile {tiling.tile_tokens}")
    parts.append(f"loss chunk {info.loss_chunks}")  # type: ignore[attr-defined]
    return ", ".join(parts)


def longest(ok: callable, start: int, resolution: int, limit: int) -> int:  # type: ignore[valid-type]
    """The longest length ``ok`` accepts: doubling from ``start``, then bisection to
    ``resolution`` tokens (0 when not even ``start`` is accepted)."""
    if not ok(start):
        return 0
    lo, hi = start, None
    while hi is None:
        n = min(2 * lo, limit)
        if n == lo:
            return lo
        if ok(n):
            lo = n
        else:
            hi = n
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution or (lo + hi) // 2
        if mid <= lo:
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def step_times(folder: Path, tokens: int, a: argparse.Namespace) -> dict[str, float]:
    """Median seconds of ``a.timed`` steps per stack at ``tokens``, interleaved step by step
    so machine load hits the stacks alike."""
    batch = batch_of(tokens, a)
    models = {s: build(s, folder, batch, a) for s in STACKS}
    times: dict[str, list[float]] = {s: [] for s in STACKS}
    for s in STACKS:
        step(models[s], batch, a.device)  # warm-up
    for _ in range(a.timed):
        for s in STACKS:
            times[s].append(step(models[s], batch, a.device)[2])
    return {s: statistics.median(v) for s, v in times.items()}


# ---------------------------------------------------------------------------- the cgroup check
def child_main(a: argparse.Namespace) -> None:
    """``--child STACK``: ``a.cgroup_steps`` steps at ``a.cgroup_tokens``, one JSON line per
    step (a killed run leaves its trace)."""
    from tightfit.pressure.probes import RSSProbe

    folder = Path(a.folder)
    batch = batch_of(a.cgroup_tokens, a)
    model = build(a.child, folder, batch, a)
    # real training steps: the adapters change, so each step's loss is a new number to match
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with open(a.log, "w") as out:
        out.write(json.dumps({"event": "built", "rss": RSSProbe().used_bytes()}) + "\n")
        out.flush()
        for i in range(a.cgroup_steps):
            loss, peak, seconds = step(model, batch, "cpu")
            opt.step()
            out.write(json.dumps({"step": i, "loss": loss, "peak": peak, "seconds": seconds,
                                  "rss": RSSProbe().used_bytes()}) + "\n")
            out.flush()


def run_capped(stack: str, folder: Path, a: argparse.Namespace, cap: int | None) -> dict:
    """Run ``--child stack`` (under a cgroup of ``cap`` bytes when given); its records."""
    from spike import detect_cap  # the cgroup detection the spike benchmark uses

    args = ["--folder", str(folder), "--cgroup-tokens", str(a.cgroup_tokens),
            "--cgroup-steps", str(a.cgroup_steps), "--budget", str(a.budget)]
    for k in ("hidden", "layers", "heads", "kv_heads", "vocab", "positions", "r", "threads"):
        args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        return _child(stack, args, detect_cap(), cap, log)


def _child(stack: str, args: list[str], cap: object, cap_bytes: int | None, log: Path) -> dict:
    """One child, under ``cap_bytes`` in a fresh memory cgroup (``spike.run_child``'s way)."""
    from spike import cgroup_figures, child_cgroup

    cmd_args = [*args, "--log", str(log)]
    # uncapped runs get a cgroup too (without a limit): their charge is measured alike
    cg, preexec = child_cgroup(cap, cap_bytes, "tightfit-longctx")  # type: ignore[arg-type]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stack, *cmd_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, preexec_fn=preexec, cwd=HERE.parent)
    _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    peak, oom = cgroup_figures(cap, cg)  # type: ignore[arg-type]
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return {"rc": rc, "killed": rc in (-9, 137), "oom_kills": oom, "cap": cap_bytes,
            "cap_kind": cap.kind, "maxrss": usage.ru_maxrss * 1024,  # type: ignore[attr-defined]
            "cgroup_peak": peak, "steps": [r for r in records if "loss" in r],
            "wall_s": time.perf_counter() - t0,
            "losses": [r["loss"] for r in records if "loss" in r]}


# ---------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=0, help="default: 3.5 × hidden")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--positions", type=int, default=131_072)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--budget", type=int, default=256 * MiB, help="bytes a step may add")
    p.add_argument("--start", type=int, default=256)
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--limit", type=int, default=65_536, help="longest length tried")
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--cgroup-tokens", type=int, default=0)
    p.add_argument("--cgroup-cap", type=int, default=0)
    p.add_argument("--cgroup-steps", type=int, default=3)
    p.add_argument("--cgroup-only", action="store_true", help="skip the searches")
    p.add_argument("--out", default=str(HERE / "results" / "long_context.md"))
    p.add_argument("--child", choices=STACKS, default=None)
    p.add_argument("--folder", default=None)
    p.add_argument("--log", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    if a.child:
        return child_main(a)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    log: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_model(folder, a)
        found = {}
        for s in ([] if a.cgroup_only else a.stacks.split(",")):
            probe = Probe(s, folder, a, log)
            found[s] = longest(probe.fits, a.start, a.resolution, a.limit)
            print(f"{s}: longest {found[s]} tokens ({time.perf_counter() - t_start:.0f} s)",
                  flush=True)
        predicted = None
        if "long" in found:
            probe = Probe("long", folder, a, log)
            predicted = longest(probe.planned, a.start, a.resolution, a.limit)
            print(f"long: predicted longest {predicted}", flush=True)
        times = step_times(folder, found["hf"], a) if found.get("hf") else {}
        capped = {}
        if a.cgroup_tokens:
            for s in ("hf", "long"):
                capped[s] = run_capped(s, folder, a, a.cgroup_cap)
                print(f"cgroup {s}: {capped[s]}", flush=True)
            for s in ("hf", "long"):
                capped[f"{s} uncapped"] = run_capped(s, folder, a, None)
                print(f"{s} uncapped: {capped[f'{s} uncapped']}", flush=True)
    result = {"args": vars(a), "found": found, "predicted_longest": predicted, "times": times,
              "capped": capped, "log": log, "load": (load0, os.getloadavg()),
              "wall_s": time.perf_counter() - t_start}
    write(result, Path(a.out))


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}×" if x and y else "—"


def write(r: dict, out: Path) -> None:
    """The results as markdown, with the raw probes as a JSON block."""
    a, f, t = r["args"], r["found"], r["times"]
    cfg = (f"hidden {a['hidden']}, intermediate {a['intermediate'] or a['hidden'] * 7 // 2}, "
           f"{a['layers']} layers, {a['heads']} heads / {a['kv_heads']} KV heads, vocabulary "
           f"{a['vocab']}, NF4 + DQ, LoRA r={a['r']} on all linears, batch 1, {a['device']}")
    lines = [
        "# Long context: the longest sequence one budget trains", "",
        f"Model: {cfg}. Budget: **{a['budget'] / MiB:.0f} MiB** a step may add "
        + ("(a *simulated* device budget on the CPU: the measured peak of live tensor bytes "
           "of one forward + backward must stay within it; nothing enforces it)."
           if a["device"] == "cpu" else "(CUDA max_memory_allocated above the weights)."),
        f"Machine: {cpu_model()}, {a['threads']} torch threads; load average before / after "
        f"{load_text(r['load'][0])} → {load_text(r['load'][1])} (shared with other jobs: "
        "compare ratios within this run). " + versions_text(), "",
        f"Search: doubling from {a['start']} tokens, then bisection to {a['resolution']}; "
        f"wall time {r['wall_s'] / 60:.1f} min.", "",
        "| stack | longest sequence (measured) | × HF | step s at HF's longest | × HF |",
        "|---|---:|---:|---:|---:|",
    ]
    if not f:  # --cgroup-only: no search, so no table of longest sequences
        lines = lines[:5] + [f"Wall time {r['wall_s'] / 60:.1f} min."]
        lines[0] = "# Long context under a real memory cgroup"
    names = {"hf": "HF (bnb 4-bit + peft + gradient_checkpointing_enable(offload=True) + SDPA)",
             "now": "tightfit now (every layer + chunked loss)",
             "long": "tightfit long (prepare, checkpoint_budget = budget)"}
    for s, n in f.items():
        st = t.get(s)
        lines.append(f"| {names[s]} | {n:,} | {_ratio(n, f.get('hf'))} | "
                     f"{'—' if st is None else f'{st:.2f}'} | {_ratio(st, t.get('hf'))} |")
    if "long" in f and "now" in f:
        lines += ["", f"tightfit long / tightfit now: **{_ratio(f['long'], f['now'])}**; "
                  f"long / HF: **{_ratio(f['long'], f.get('hf'))}**."]
    if r["predicted_longest"] is not None:
        p, m = r["predicted_longest"], f.get("long")
        err = f"{(p - m) / m:+.1%}" if m else "—"
        lines += ["", f"Predicted longest for tightfit long (the longest sequence prepare "
                  f"plans within the budget): {p:,} tokens; measured {m:,} ({err})."]
    probes = [x for x in r["log"] if x["stack"] == "long" and "peak" in x and "predicted" in x]
    if probes:
        lines += ["", "Predicted vs measured step peak, tightfit long (each probe):", "",
                  "| tokens | plan | predicted MiB | measured MiB | error | step s |",
                  "|---:|---|---:|---:|---:|---:|"]
        for x in sorted(probes, key=lambda x: x["tokens"]):
            lines.append(f"| {x['tokens']:,} | {x.get('plan', '')} | {x['predicted'] / MiB:.1f} | "
                         f"{x['peak'] / MiB:.1f} | {(x['predicted'] - x['peak']) / x['peak']:+.1%}"
                         f" | {x['seconds']:.1f} |")
    if r["capped"]:
        lines += ["", f"Real memory cgroup ({next(iter(r['capped'].values()))['cap_kind']}), "
                  f"{a['cgroup_cap'] / MiB:.0f} MiB for the whole process, "
                  f"{a['cgroup_tokens']:,} tokens, {a['cgroup_steps']} training steps (AdamW on "
                  "the adapters):", "",
                  "| run | exit | killed | OOM kills | max RSS MiB | cgroup peak MiB | steps done "
                  "| losses |", "|---|---:|---|---:|---:|---:|---:|---|"]
        for k, c in r["capped"].items():
            cg = "—" if c.get("cgroup_peak") is None else f"{c['cgroup_peak'] / MiB:.0f}"
            lines.append(f"| {k} | {c['rc']} | {c['killed']} | {c['oom_kills']} | "
                         f"{c['maxrss'] / MiB:.0f} | {cg} | {len(c['losses'])} | "
                         f"{', '.join(f'{v:.6f}' for v in c['losses'])} |")
    lines += ["", "<details><summary>every probe</summary>", "", "```json",
              json.dumps(r["log"], indent=None)[:20000], "```", "</details>", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(out.read_text())


if __name__ == "__main__":
    main()
