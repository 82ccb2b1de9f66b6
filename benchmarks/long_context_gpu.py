"""Long context on a lent GPU: the longest sequence a Llama-3.1-8B-shaped QLoRA step trains.

A Llama-3.1-8B config (hidden 4096, intermediate 14336, 32 layers, 32 / 8 heads, vocabulary
128256) with **random** weights, NF4 + double quant, LoRA r=32 on all linears, batch 1,
under a device cap (``torch.cuda.set_per_process_memory_fraction(cap / total)``, 24 GiB by
default). Per stack (HF: bitsandbytes 4-bit + peft + ``gradient_checkpointing_enable(
offload=True)``, transformers' own offload of the checkpointed inputs to pinned host memory,
``long_context.hf_offload``; tightfit: ``tightfit.prepare`` with its defaults, the plan chosen
from the free memory under the cap, and the new placements: LoRA computing in the compute
dtype (``--lora-compute``, default ``compute_dtype``), paged base weights
(``--resident-layers``: ``plan`` takes the planner's recommended row's number, ``all`` keeps
every layer's NF4 weights on the device) and tiled MLPs (``--mlp-tile``, default ``auto``)) the longest sequence for which one training step (forward + backward) completes:
doubling from ``--start``, then bisection to ``--resolution``, within a time box per stack.
Beside it, tightfit's predicted longest (``tightfit.plan(..., maximize="seq")``) and the
tokens/s of the longest step. The reference to pass: Unsloth's 78,475 tokens for this model
on a 24 GiB card.

The model is built once per stack and reused by every probe (only the activation plan is
redone per length): on the meta device, then layer by layer materialised with random bf16
weights on the device and quantized there, so the full bf16 model never exists.

``--tiny`` runs the same code path on a small config on the CPU, where the cap is a
*simulated* budget (``--budget``: a step fits when its measured peak of live tensor bytes is
within it): that is how it is tested without a GPU (tests/qlora/test_longctx_gpu_script.py).
Results, on stdout and in ``--out`` (JSON lines, each written and flushed as it happens, so a
run killed by its time box keeps what it measured): a ``run`` line (device, cap, tightfit's
predicted longest), one line per probe, a ``stack_summary`` line as each stack finishes, and
the ``summary`` line at the end. A probe that runs out of memory (``torch.OutOfMemoryError``)
or for which no plan fits (``ValueError``) "does not fit"; any other error (a sticky CUDA error
such as ``torch.AcceleratorError``, after which the context is unusable) is written as a
``fatal`` line and stops the script, instead of reading as "does not fit" for every later
probe.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_context import hf_offload, step  # noqa: E402  (one measured step, HF's offload)

import tightfit  # noqa: E402

GiB = 1 << 30
UNSLOTH_TOKENS = 78_475
SHAPES = {
    "8b": {"vocab_size": 128_256, "hidden_size": 4096, "intermediate_size": 14_336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 131_072, "rope_theta": 500_000.0},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 224,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 8192},
}


def build_base(shape: dict, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random Llama of ``shape`` with NF4 + DQ linears, built layer by layer on ``dev``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tightfit.qlora.quantize import quantize_linears

    cfg = LlamaConfig(**shape, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    torch.manual_seed(0)

    def materialise(module: torch.nn.Module) -> None:
        module.to_empty(device=dev, recurse=True)
        for name, p in module.named_parameters():
            p.requires_grad_(False)
            if name.endswith("norm.weight") or name == "weight" and p.dim() == 1:
                p.data = torch.ones(p.shape, dtype=dtype, device=dev)
            else:  # random weights, as the CPU benchmark's (std 0.02: HF's initializer_range)
                p.data = (torch.randn(p.shape, dtype=dtype, device=dev) * 0.02)

    for layer in model.model.layers:  # one layer in bf16 at a time, then its 4-bit linears
        materialise(layer)
        quantize_linears(layer, quant_type="nf4", double_quant=True, compute_dtype=dtype,
                         device=dev)
    for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
        materialise(m)
    # its buffers were made on meta: a new one (built outside the meta context, on the CPU)
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg).to(dev)
    model.config.use_cache = False
    return model.train()


def build(stack: str, a: argparse.Namespace, first: dict) -> torch.nn.Module:
    """The model of ``stack``, planned (tightfit) for the batch ``first``."""
    dev, dtype = torch.device(a.device), torch.bfloat16 if a.device == "cuda" else torch.float32
    base = build_base(SHAPES["tiny" if a.tiny else "8b"], dev, dtype)
    if stack == "hf":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(
            base, use_gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False})
        hf_offload(base)
        return get_peft_model(base, LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=0.0,
                                               target_modules="all-linear",
                                               task_type="CAUSAL_LM")).train()
    # quant=None: the linears are 4-bit already (quantized layer by layer above)
    lora = {"r": a.r, "alpha": 2 * a.r, "dropout": 0.0, "compute": a.lora_compute}
    model = tightfit.prepare(base, quant=None, lora=lora, checkpoint_budget=a.budget or None,
                             mlp_tile=_tile(a.mlp_tile), example=first, device=dev)
    if a.resident != "all":  # prepare refuses resident_layers with quant=None (the base was
        # built 4-bit above): paged here; every probe's replan sees the room paging leaves
        tightfit.enable_paged_base(model, int(a.resident))
    info = model.tightfit_info  # every probe replans; the MLP tile's cost model reads quant
    info.options = dataclasses.replace(info.options, quant="nf4")
    return model


def replan(model: torch.nn.Module, batch: dict) -> torch.nn.Module:
    """Redo tightfit's activation plan (checkpoint, offload, MLP tile, loss chunk) for
    ``batch``, on the same weights and adapters."""
    import tightfit.checkpoint as ck
    from tightfit.loss import disable_chunked_loss, enable_chunked_loss
    from tightfit.qlora.prepare import plan_step

    info = model.tightfit_info
    ck.disable(model)
    ck.disable_tiling(model)
    info.tiling = None
    if info.loss_chunks is not None:
        disable_chunked_loss(model)
        enable_chunked_loss(model, info.options.loss_chunks)
        info.loss_chunks = info.options.loss_chunks
    info.notes = []
    plan_step(model, info, batch)
    return model


def probe(stack: str, model: torch.nn.Module, tokens: int, a: argparse.Namespace) -> dict:
    """One training step at ``tokens``: did it complete (within the budget on the CPU)?"""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randint(0, model.config.vocab_size, (1, tokens), generator=g).to(a.device)
    batch = {"input_ids": x, "labels": x}
    rec: dict = {"stack": stack, "tokens": tokens}
    try:
        if stack == "tightfit":
            replan(model, batch)
            plan = model.tightfit_info.plan
            rec["predicted"] = getattr(plan, "predicted_peak_bytes", None)
        loss, peak, seconds = step(model, batch, a.device)
        rec.update(ok=a.device == "cuda" or peak <= a.budget, loss=loss, peak=peak,
                   seconds=seconds, tokens_per_s=tokens / seconds)
    except (torch.OutOfMemoryError, ValueError) as e:  # OOM, or no plan fits
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:160]}")
    # any other error propagates, before the clean-up below touches a context it may have
    # broken (a sticky CUDA error fails every later call): main() reports it and stops
    model.zero_grad(set_to_none=True)
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return rec


class ProbeFailed(RuntimeError):
    """A probe raised something other than "does not fit": the run stops."""


def search(ok: callable, a: argparse.Namespace) -> tuple[int, int | None, bool]:  # type: ignore[valid-type]
    """Doubling from ``a.start`` then bisection to ``a.resolution`` within ``a.box`` seconds:
    ``(longest that completed, shortest that failed or None, stopped by the time box)``."""
    t0, lo, hi = time.perf_counter(), 0, None
    n = a.start
    while hi is None or hi - lo > a.resolution:
        if time.perf_counter() - t0 > a.box:
            return lo, hi, True
        if ok(n):
            lo = n
        else:
            hi = n
        if hi is None:
            if n >= a.limit:
                break
            n = min(2 * n, a.limit)
        else:
            n = (lo + hi) // 2 // a.resolution * a.resolution
            if n <= lo:
                break
    return lo, hi, False


def _tile(v: str) -> int | str:
    return int(v) if v.isdigit() else v


def predicted_longest(a: argparse.Namespace) -> int | None:
    """tightfit's planner: the longest sequence it recommends under the cap (and, for
    ``--resident-layers plan``, its resident layers into ``a.resident``)."""
    shape = {"model_type": "llama", **SHAPES["tiny" if a.tiny else "8b"]}
    # the planner models a CUDA device (1 GiB of overhead included): the tiny CPU path asks
    # it about a 2 GiB one only to run the code, its answer means nothing there
    gpu = 2 * GiB if a.tiny else int(a.cap_gib * GiB)
    try:
        report = tightfit.plan(shape, gpu=gpu, lora_r=a.r, maximize="seq",
                               granularity=a.resolution, lora_compute=a.lora_compute)
    except ValueError as e:
        print(json.dumps({"planner_error": str(e)[:200]}))
        return None
    best = report.recommended
    setup = getattr(best, "setup", None)
    if a.resident_layers == "plan":
        a.resident = str(getattr(setup, "resident_layers", "all"))
    print(json.dumps({"planned": {"resident_layers": getattr(setup, "resident_layers", None),
                                  "mlp_tile": getattr(setup, "mlp_tile", None)}}))
    return None if best is None else int(best.maximum)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the small config (CPU test path)")
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--budget", type=int, default=0, help="CPU: simulated step budget (bytes)")
    p.add_argument("--r", type=int, default=32)
    p.add_argument("--start", type=int, default=16_384)
    p.add_argument("--resolution", type=int, default=8192)
    p.add_argument("--limit", type=int, default=131_072)
    p.add_argument("--box", type=float, default=70.0, help="seconds of probing per stack")
    p.add_argument("--stacks", default="tightfit,hf")
    p.add_argument("--out", default=None, help="JSON lines file")
    p.add_argument("--lora-compute", default="compute_dtype",
                   choices=("compute_dtype", "lora_dtype"))
    p.add_argument("--resident-layers", default="plan",
                   help="plan (the planner's), all, or a number of layers")
    p.add_argument("--mlp-tile", default="auto", help="auto, none or tokens")
    a = p.parse_args(argv)
    a.resident = "all" if a.resident_layers == "plan" else a.resident_layers
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    warnings.filterwarnings("ignore")
    out = open(a.out, "w") if a.out else None  # noqa: SIM115 - line by line, flushed

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    try:
        return _run(a, emit)
    finally:
        if out is not None:
            out.close()


def _run(a: argparse.Namespace, emit: callable) -> dict:  # type: ignore[valid-type]
    if a.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GiB / total))
    summary: dict = {"device": a.device, "cap_gib": a.cap_gib if a.device == "cuda" else None,
                     "simulated_budget": a.budget if a.device != "cuda" else None,
                     "predicted_longest": predicted_longest(a), "unsloth": UNSLOTH_TOKENS,
                     "lora_compute": a.lora_compute, "mlp_tile": a.mlp_tile}
    summary["resident_layers"] = a.resident  # after the planner (plan: its number)
    emit({"run": dict(summary)})  # on disk before the first (long) build
    for stack in a.stacks.split(","):
        t0 = time.perf_counter()
        x = torch.zeros(1, min(a.start, 2048), dtype=torch.long, device=a.device)
        model = build(stack, a, {"input_ids": x, "labels": x})
        built_s = time.perf_counter() - t0
        records: list[dict] = []

        def ok(n: int, stack: str = stack, model: torch.nn.Module = model,
               records: list[dict] = records) -> bool:
            try:
                rec = probe(stack, model, n, a)
            except Exception as e:
                why = f"{type(e).__name__}: {str(e)[:300]}"
                emit({"stack": stack, "tokens": n, "fatal": why})
                raise ProbeFailed(
                    f"long_context_gpu: the {stack} probe at {n} tokens raised {why}. That is "
                    "not out-of-memory; after a CUDA error the context is unusable, so the run "
                    f"stops here (the probes so far are in {a.out or 'the output above'})."
                ) from e
            records.append(rec)
            emit(rec)
            return bool(rec["ok"])

        lo, hi, boxed = search(ok, a)
        best = next((r for r in records if r["tokens"] == lo and r["ok"]), {})
        summary[stack] = {"longest": lo, "first_failed": hi, "time_boxed": boxed,
                          "tokens_per_s": best.get("tokens_per_s"), "build_s": built_s,
                          "probes": len(records)}
        emit({"stack_summary": {stack: summary[stack]}})
        del model, ok
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    emit({"summary": summary})
    return summary


if __name__ == "__main__":
    main()
