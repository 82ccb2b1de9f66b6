"""Check that FSDP2 with a sharded 4-bit base trains QLoRA exactly like one process.

Run it under torchrun, or in one plain process (the reference)::

    python -m tightfit.distributed.qlora_check --out /tmp/q1            # one process
    torchrun --nproc_per_node 2 -m tightfit.distributed.qlora_check --out /tmp/q2
    torchrun --nproc_per_node 2 -m tightfit.distributed.qlora_check --out /tmp/q2r \\
        --resume-from /tmp/q1/saved                                       # saved on 1, on 2
    python -m tightfit.distributed.qlora_check --out /tmp/q1r --resume-from /tmp/q2/saved

A tiny Llama-architecture model is written as safetensors to ``--out/model`` (once, by rank
0), then every rank builds the QLoRA stack on it: NF4 + double quant, LoRA, the chunked
loss, ``--checkpoint``. Under torchrun the model is loaded shard by shard
(:func:`tightfit.distributed.sharded_load.load_sharded`: meta first, each rank quantizes one
layer at a time and keeps its shard), so the base's codes, absmax and nested absmax are
FSDP2 shards gathered a block at a time; in one process it is :func:`tightfit.prepare`. It
trains ``--steps`` steps of paged AdamW on each rank's rows of the same global batches, saves
the resume state with DCP after ``--save-at`` steps, and writes ``result.json`` (the mean
loss of every step; per rank: the base's bytes held, the largest gathered at once, the
largest block's; on CUDA also the rank's ``max_memory_allocated``) and ``adapter.pt`` (the full LoRA params, rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn

from tightfit.distributed import dcp, launch
from tightfit.distributed.parallelize import shards_on_host
from tightfit.optim.dtensor import is_dtensor
from tightfit.qlora.shardable import BASE_PIECES, base_bytes, shardable_layers

__all__ = ["QloraCheck", "main", "run", "write_tiny_model"]


@dataclass
class QloraCheck:
    """What to run; every field is a command-line flag of the same name."""

    out: str
    steps: int = 4
    save_at: int = 2
    batch: int = 4  # global rows; must divide by the ranks
    seq: int = 16
    lr: float = 1e-2
    layers: int = 2
    hidden: int = 64
    checkpoint: str = "every"
    offload: str = "none"  # "inputs"/"all": each checkpointed segment's tensors to disk (CPU)
    mlp_tile: int = 0  # tokens per tile of each MLP; 0: untiled
    quant: str = "nf4"  # "nf4", "fp4" or "none" (a frozen full-precision base)
    double_quant: bool = True
    resume_from: str = ""
    model: str = ""  # safetensors folder; default OUT/model, written when missing
    page_bytes: int = 4096
    device_budget: int = 8192  # per rank: pages move every step
    device: str = "auto"
    seed: int = 0
    fsdp_offload: bool = False  # under torchrun: the shards on the host (CPUOffloadPolicy)


def write_tiny_model(folder: str, opts: QloraCheck) -> None:
    """A tiny Llama (vocabulary 67: uneven shards) saved as safetensors in ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=67, hidden_size=opts.hidden, intermediate_size=2 * opts.hidden,
        num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1234)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def model_folder(opts: QloraCheck) -> str:
    """Where the model's safetensors are (``--model``, else ``OUT/model``)."""
    return opts.model or os.path.join(opts.out, "model")


def _batch(opts: QloraCheck, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(opts.seed * 100_003 + step)
    return torch.randint(0, 67, (opts.batch, opts.seq), generator=gen)


def _build(opts: QloraCheck, info: launch.DistInfo) -> nn.Module:
    from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions

    options = PrepareOptions(
        quant=None if opts.quant == "none" else opts.quant,  # type: ignore[arg-type]
        double_quant=opts.double_quant, checkpoint=opts.checkpoint,
        loss_chunks=8, offload=opts.offload, mlp_tile=opts.mlp_tile or None,
        offload_dir=os.path.join(opts.out, f"offload-rank{info.rank}"),
    )  # type: ignore[arg-type]  # fmt: skip
    lora = LoraOptions(r=4, alpha=8)
    example = {"input_ids": _batch(opts, 0)[: opts.batch // info.world_size]}
    example["labels"] = example["input_ids"]
    folder = model_folder(opts)
    torch.manual_seed(opts.seed)  # LoRA's initial A: the same draws in both paths
    if info.distributed:
        from tightfit.distributed.sharded_load import load_sharded

        return load_sharded(folder, options, lora=lora, example=example, device=info.device,
                            fsdp_offload=opts.fsdp_offload)
    from tightfit.qlora.prepare import prepare

    return prepare(folder, options, lora=lora, example=example, device=info.device)


def _watch_gathered(model: nn.Module) -> dict[str, int]:
    """Hooks that record the most base bytes gathered at once (seen at each 4-bit layer's
    forward, recompute and backward): the pieces whose module attribute is a plain tensor,
    i.e. FSDP2 has swapped in the unsharded parameter."""
    layers = [layer for _, layer in shardable_layers(model)]
    seen = {"gathered_peak": 0}

    def look(*_args: object) -> None:
        now = 0
        for layer in layers:
            for piece in BASE_PIECES:
                p = layer._parameters.get(piece)
                if p is not None and not is_dtensor(p):
                    now += p.untyped_storage().nbytes()
        seen["gathered_peak"] = max(seen["gathered_peak"], now)

    for layer in layers:
        layer.register_forward_pre_hook(look)
        layer.register_full_backward_pre_hook(look)
    return seen


def _own_unit(model: nn.Module) -> bool:
    """Whether the input embedding is an FSDP2 unit of its own (gathered for its lookup)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model.get_input_embeddings(), FSDPModule)


def _optimizer(opts: QloraCheck, model: nn.Module, rank: int) -> torch.optim.Optimizer:
    from tightfit.optim.adamw import PagedAdamW

    params = [p for p in model.parameters() if p.requires_grad]
    return PagedAdamW(params, lr=opts.lr, weight_decay=0.0, page_bytes=opts.page_bytes,
                      device_budget=opts.device_budget,
                      spill_dir=os.path.join(opts.out, f"spill-rank{rank}"))  # fmt: skip


def _mean(value: float, info: launch.DistInfo) -> float:
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t.item()) / info.world_size


def _adapter(model: nn.Module, info: launch.DistInfo) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if is_dtensor(p) else p
            out[name] = full.detach().to("cpu", copy=True)
    return out if info.is_main else {}


def run(opts: QloraCheck, info: launch.DistInfo) -> dict:
    """Train (or resume and finish) on this process's ranks; rank 0 writes the results."""
    if info.is_main and not os.path.isdir(model_folder(opts)):
        write_tiny_model(model_folder(opts), opts)
    if info.distributed:
        torch.distributed.barrier()
    model = _build(opts, info)
    optimizer = _optimizer(opts, model, info.rank)
    start = 0
    if opts.resume_from:
        start = int(dcp.load(opts.resume_from, model, optimizer, trainable_only=True)["step"])
    seen = _watch_gathered(model)
    per = opts.batch // info.world_size
    losses = []
    for step in range(start, opts.steps):
        ids = _batch(opts, step)[info.rank * per : (info.rank + 1) * per].to(info.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(_mean(loss.item(), info))
        if step + 1 == opts.save_at and not opts.resume_from:
            dcp.save(os.path.join(opts.out, "saved"), model, optimizer,
                     extra={"step": step + 1}, trainable_only=True)  # fmt: skip
    mine = {**base_bytes(model), **seen, "embedding_unit": _own_unit(model),
            "shards_on_host": info.distributed and shards_on_host(model)}
    if info.device.type == "cuda":  # the whole rank's peak: base, LoRA, state, activations
        mine["cuda_peak"] = torch.cuda.max_memory_allocated(info.device)
    ranks = launch.gather_objects(mine)
    adapter = _adapter(model, info)
    optimizer.close()
    result = {"options": asdict(opts), "world_size": info.world_size, "start": start,
              "losses": losses, "ranks": ranks}  # fmt: skip
    if info.is_main:
        torch.save(adapter, os.path.join(opts.out, "adapter.pt"))
        with open(os.path.join(opts.out, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (the fields of :class:`QloraCheck`) and :func:`run`."""
    parser = argparse.ArgumentParser(prog="tightfit.distributed.qlora_check")
    for name, default in asdict(QloraCheck(out="")).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default, required=name == "out")
    opts = QloraCheck(**vars(parser.parse_args(argv)))
    os.makedirs(opts.out, exist_ok=True)
    info = launch.init_from_env(device=opts.device)  # type: ignore[arg-type]
    if opts.batch % info.world_size:
        raise ValueError(f"--batch {opts.batch} must divide by the {info.world_size} ranks")
    result = run(opts, info)
    if info.is_main:
        print(json.dumps({"losses": result["losses"], "ranks": result["ranks"]}), flush=True)
    if info.distributed:
        launch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
