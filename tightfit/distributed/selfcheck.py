"""Check that a paged optimizer trains a sharded model exactly like torch's AdamW.

Run it under torchrun (``--nproc_per_node N``; CPU/gloo or CUDA/NCCL)::

    torchrun --nproc_per_node 2 -m tightfit.distributed.selfcheck --strategy fsdp --out /tmp/sc

Every rank builds the same tiny Llama-architecture model, wraps it (FSDP2 or DDP), and trains it
on its slice of each global batch with the chosen optimizer (PagedAdamW under a budget that
forces paging, by default). Along the way it saves a DCP checkpoint after ``--save-at`` steps,
then resumes a fresh model + optimizer from that checkpoint and finishes the run again. Rank 0
also trains an unsharded copy with ``torch.optim.AdamW`` on the whole global batch: the
reference. It writes ``final``/``resumed``/``reference`` parameters (``.pt``) and a JSON report
with per-rank optimizer stats to ``--out`` and exits 1 if any run strays beyond ``--tol``.
``--resume-only`` resumes an existing checkpoint on however many ranks it is launched with, or,
run with plain ``python -m``, in one process on an unwrapped model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from tightfit.distributed import dcp, launch
from tightfit.distributed.parallelize import shard_model
from tightfit.optim.dtensor import local_tensor


@dataclass
class CheckOptions:
    """What to run; every field is a command-line flag of the same name."""

    out: str
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    optim: Literal["paged", "paged8bit", "torch"] = "paged"
    steps: int = 6
    save_at: int = 3
    batch: int = 4  # global batch (rows); must divide by the number of ranks
    seq: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    page_bytes: int = 4096
    device_budget: int = 16384  # per rank; a fraction of the state so that pages move
    tol: float = 1e-5
    resume_only: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0


def tiny_llama(seed: int, device: torch.device) -> nn.Module:
    """A 2-layer Llama-architecture model; vocab 67 makes FSDP2's dim-0 shards uneven."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device)


def global_batch(opts: CheckOptions, step: int, device: torch.device) -> torch.Tensor:
    """Token ids of one global batch; a function of (seed, step) so a resume can redo it."""
    gen = torch.Generator().manual_seed(opts.seed * 100_003 + step)
    return torch.randint(0, 67, (opts.batch, opts.seq), generator=gen).to(device)


def make_optimizer(opts: CheckOptions, model: nn.Module, rank: int) -> torch.optim.Optimizer:
    """The optimizer under test, on ``model``'s (possibly DTensor) parameters."""
    if opts.optim == "torch":
        return torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    from tightfit.optim.adamw import PagedAdamW
    from tightfit.optim.adamw8bit import PagedAdamW8bit

    paging = {"page_bytes": opts.page_bytes, "device_budget": opts.device_budget,
              "spill_dir": os.path.join(opts.out, f"spill-rank{rank}")}  # fmt: skip
    if opts.optim == "paged8bit":
        # min_8bit_size=256: the tiny model's params (at most 2,144 elements) take 8-bit state.
        # 8-bit differs from the fp32 reference by its quantization (pass a looser --tol), and
        # FSDP2's uneven shards cut the 256-element blocks differently from one process.
        return PagedAdamW8bit(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay,
                              min_8bit_size=256, **paging)  # fmt: skip
    return PagedAdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay, **paging)


def train(opts, model, optimizer, info, start: int, stop: int) -> None:
    """Steps ``start..stop-1``: each rank's rows of the global batch, mean token loss."""
    per = opts.batch // info.world_size
    for step in range(start, stop):
        ids = global_batch(opts, step, info.device)[info.rank * per : (info.rank + 1) * per]
        # Equal token counts on every rank, so the mean of rank means is the global mean.
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters on the CPU (rank 0 only; other ranks get ``{}``)."""
    if not torch.distributed.is_initialized():
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=sd_opts).items()}


def stats_of(optimizer: torch.optim.Optimizer) -> dict:
    """Per-rank figures: the optimizer's ``memory_stats()`` (if any) and the local elements."""
    fn = getattr(optimizer, "memory_stats", None)
    out = dict(fn()) if fn is not None else {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out["local_elements"] = sum(local_tensor(p).numel() for p in params)
    out["global_elements"] = sum(p.numel() for p in params)
    return out


def reference_params(opts: CheckOptions, device: torch.device) -> dict[str, torch.Tensor]:
    """Single-process ``torch.optim.AdamW`` on whole global batches: the expected result.

    Written to ``out/reference.pt``; a ``--resume-only`` run reuses the file of the full run.
    """
    path = os.path.join(opts.out, "reference.pt")
    if opts.resume_only and os.path.isfile(path):
        return torch.load(path, weights_only=True)
    model = tiny_llama(opts.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    train(opts, model, optimizer, launch.DistInfo(device=device), 0, opts.steps)
    reference = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(reference, path)
    return reference


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over all parameters (keys must match)."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _build(opts, info):
    model = tiny_llama(opts.seed, info.device)
    if info.distributed:  # a plain process (no torchrun) may only resume: see main()
        model = shard_model(model, opts.strategy)
    return model, make_optimizer(opts, model, info.rank)


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 0 when every comparison is within ``--tol``."""
    parser = argparse.ArgumentParser(prog="tightfit.distributed.selfcheck")
    for name, default in asdict(CheckOptions(out="")).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(default), default=default, required=name == "out")
    opts = CheckOptions(**vars(parser.parse_args(argv)))
    if not 0 < opts.save_at < opts.steps:
        raise ValueError(f"--save-at {opts.save_at} must lie in 1..{opts.steps - 1} (--steps)")
    info = launch.init_from_env(device=opts.device)
    if opts.batch % info.world_size:
        raise ValueError(f"--batch {opts.batch} must divide by the {info.world_size} ranks")
    if not (info.distributed or opts.resume_only):
        raise ValueError(
            "launch with torchrun (e.g. --nproc_per_node 2); without it only --resume-only "
            "runs (an unwrapped model in this one process)"
        )
    os.makedirs(opts.out, exist_ok=True)
    ckpt = os.path.join(opts.out, "ckpt")
    tag = f"w{info.world_size}" if info.distributed else "plain"
    report: dict = {"options": asdict(opts), "world_size": info.world_size}

    if not opts.resume_only:
        model, optimizer = _build(opts, info)
        init = full_params(model)
        if info.is_main:
            torch.save(init, os.path.join(opts.out, "init.pt"))
        train(opts, model, optimizer, info, 0, opts.save_at)
        dcp.save(ckpt, model, optimizer, extra={"step": opts.save_at})
        train(opts, model, optimizer, info, opts.save_at, opts.steps)
        final = full_params(model)
        report["stats_final"] = launch.gather_objects(stats_of(optimizer))
        getattr(optimizer, "close", lambda: None)()
        if info.is_main:
            torch.save(final, os.path.join(opts.out, f"final_{tag}.pt"))

    model, optimizer = _build(opts, info)
    extra = dcp.load(ckpt, model, optimizer)
    report["stats_after_load"] = launch.gather_objects(stats_of(optimizer))
    train(opts, model, optimizer, info, int(extra["step"]), opts.steps)
    resumed = full_params(model)
    report["stats_resumed"] = launch.gather_objects(stats_of(optimizer))
    getattr(optimizer, "close", lambda: None)()

    ok = True
    if info.is_main:
        torch.save(resumed, os.path.join(opts.out, f"resumed_{tag}.pt"))
        reference = reference_params(opts, info.device)
        report["max_diff_resumed"] = max_diff(resumed, reference)
        if not opts.resume_only:
            report["max_diff_final"] = max_diff(final, reference)
        diffs = {k: v for k, v in report.items() if k.startswith("max_diff")}
        ok = all(v <= opts.tol for v in diffs.values())
        with open(os.path.join(opts.out, f"report_{tag}.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"selfcheck {opts.strategy}/{opts.optim} on {info.world_size} rank(s): "
              f"{diffs} tol={opts.tol} -> {'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    if info.distributed:  # a plain process may hold a group it did not make: leave it
        launch.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
