"""End to end: one model and batch under tightfit's stack vs the Hugging Face stack.

(a) tightfit: ``tightfit.prepare`` (bitsandbytes NF4 + double quant, peft LoRA, tightfit's
    checkpoint plan with its default budget, chunked LM head + loss) + ``PagedAdamW``.
(b) HF: ``from_pretrained(quantization_config=BitsAndBytesConfig(4-bit NF4, double quant))``
    + ``prepare_model_for_kbit_training`` + HF gradient checkpointing (every layer,
    non-reentrant) + peft LoRA (same r, alpha, targets) + ``torch.optim.AdamW``.

Peak memory is measured the same way for both with ``tightfit.measure.tracker.MemoryTracker`` from
before the model is loaded: the peak of live tensor bytes during training steps (weights,
quantization constants, adapters, optimizer state and the step's transient activations and
gradients). On the CPU those are live storage bytes (RSS would mix in allocator caching and
library buffers); on CUDA, ``max_memory_allocated``. Step times are medians of untracked steps,
the two stacks interleaved step by step so machine load hits both alike.

Run: ``.venv/bin/python benchmarks/e2e.py [--quick]``; writes ``benchmarks/results/e2e.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from environment import cpu_model, load_text, versions_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tightfit  # noqa: E402
from tightfit.measure.tracker import MemoryTracker  # noqa: E402

MiB = 1 << 20


def _save_model(folder: Path, a: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 64, max_position_embeddings=max(a.seq, 128),
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def build_tightfit(folder: Path, batch: dict, device: torch.device, a: argparse.Namespace):
    model = tightfit.prepare(folder, lora={"r": a.r, "alpha": 2 * a.r}, checkpoint="budget",
                             example=batch, device=device)
    opt = tightfit.optimizer_for(model, kind="paged_adamw", lr=1e-4)
    return model, opt


def build_hf(folder: Path, batch: dict, device: torch.device, a: argparse.Namespace):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=dtype,
                                                 device_map=str(device))
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def step(model, opt, batch) -> float:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (params, buffers, 4-bit quantization states),
    each storage once. Counted directly: weights read from safetensors are memory-mapped and
    never pass through the tracker's dispatch mode."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        qs = getattr(t, "quant_state", None)
        while qs is not None:
            add(qs.absmax)
            add(qs.code)
            qs = getattr(qs, "state2", None)
    return sum(seen.values())


def measure_peak(build, folder, batch, device, a):
    """Peak bytes while training: the model's tensors (counted) + everything the training
    steps allocate and keep or free (optimizer state, activations, grads: tracked)."""
    with MemoryTracker(device) as mt:
        model, opt = build(folder, batch, device, a)
        at_mark = mt.current_bytes
        mt.mark("train")
        losses = [step(model, opt, batch) for _ in range(2)]
    if device.type == "cuda":  # the allocator saw everything, the weights included
        return model, opt, mt.phase_peaks["train"], losses
    return model, opt, model_bytes(model) + mt.phase_peaks["train"] - at_mark, losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per stack")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: a busy shared machine stalls two badly)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "e2e.md"))
    a = p.parse_args()
    if a.quick:
        a.hidden, a.layers, a.vocab, a.seq, a.steps = 128, 2, 4096, 128, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        _save_model(folder, a)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
        stacks = {"tightfit": build_tightfit, "HF": build_hf}
        built, peaks, first = {}, {}, {}
        for name, build in stacks.items():
            torch.manual_seed(0)
            model, opt, peak, losses = measure_peak(build, folder, batch, device, a)
            built[name], peaks[name], first[name] = (model, opt), peak, losses
            print(f"{name}: train-phase peak {peak / MiB:.1f} MiB, losses {losses}", flush=True)
        times: dict[str, list[float]] = {n: [] for n in stacks}
        for _ in range(a.steps):  # interleaved: load changes hit both stacks alike
            for name in stacks:
                model, opt = built[name]
                sync(device)
                t0 = time.perf_counter()
                step(model, opt, batch)
                sync(device)
                times[name].append(time.perf_counter() - t0)
        plan = built["tightfit"][0].tightfit_info.plan
        load1 = os.getloadavg()

    med = {n: statistics.median(v) for n, v in times.items()}
    peak_ratio = peaks["tightfit"] / peaks["HF"]
    time_ratio = med["tightfit"] / med["HF"]
    lines = [
        "# End to end: tightfit stack vs Hugging Face stack",
        "",
        f"Command: `.venv/bin/python benchmarks/e2e.py{' --quick' if a.quick else ''}`",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, device {device}, "
        f"torch threads {torch.get_num_threads() if device.type == 'cpu' else '-'}",
        f"- load average at start {load_text(load0)}, at end "
        f"{load1[0]:.2f} (the machine is shared with other engineers' work: times are noisy, "
        "ratios of interleaved steps less so)",
        f"- versions: {versions_text()}",
        f"- model: Llama architecture, hidden {a.hidden}, {a.layers} layers, vocabulary "
        f"{a.vocab}, random weights; batch {a.batch} x {a.seq} tokens; LoRA r={a.r} on all "
        "linear layers; compute dtype "
        f"{'bfloat16' if device.type == 'cuda' else 'float32'}",
        "- (a) tightfit: prepare() = NF4 + double quant (bitsandbytes), LoRA (peft), checkpoint "
        "plan 'budget' with its default budget (halfway between the smallest plan's peak and no "
        "checkpointing), "
        "chunked LM head + loss; PagedAdamW (no budget: state stays on the device tier)",
        "- (b) HF: BitsAndBytesConfig 4-bit NF4 + double quant, prepare_model_for_kbit_training, "
        "gradient checkpointing on every layer (non-reentrant), peft LoRA, torch.optim.AdamW",
        "- peak: the model's tensors (weights, 4-bit constants, adapters; counted, as safetensors "
        "weights are memory-mapped) + the peak of what two training steps allocate (optimizer "
        "state, activations, grads; MemoryTracker). CUDA: max_memory_allocated from before load",
        f"- step time: median of {a.steps} untracked steps per stack, interleaved",
        "",
        "| stack | peak MiB | step time s (median) | steps (s) |",
        "|---|---|---|---|",
    ]
    for n in stacks:
        lines.append(f"| {n} | {peaks[n] / MiB:.1f} | {med[n]:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in times[n])} |")
    ok_peak, ok_time = peak_ratio <= 0.9, time_ratio <= 1.05
    lines += [
        "",
        f"- peak ratio tightfit / HF = **{peak_ratio:.3f}** (target <= 0.9): "
        f"**{'met' if ok_peak else 'missed'}**",
        f"- step-time ratio tightfit / HF = **{time_ratio:.3f}** (target <= 1.05): "
        f"**{'met' if ok_time else 'missed'}**",
        f"- first two losses: tightfit {first['tightfit']}, HF {first['HF']} (same weights "
        "and batch; NF4 math is the same bitsandbytes code)",
        "",
        "tightfit's checkpoint plan:",
        "",
        "```",
        str(plan),
        "```",
        "",
    ]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
