"""Load a QLoRA model under FSDP2 without a whole copy on any rank: meta first, then shards.

:func:`load_sharded` builds the model from its config with every parameter on the meta device
(buffers, such as the rotary tables, are computed for real: they are small), swaps the linear
layers for 4-bit ones, adds the LoRA adapters (real and small, drawn as :func:`tightfit.prepare`
draws them: same layers, same order, same RNG), turns the 4-bit layers into
:class:`~tightfit.qlora.shardable.ShardableLinear4bit` of the quantized shapes, and shards it
all with FSDP2 (:func:`~tightfit.distributed.parallelize.shard_model`) while still on meta.
Only then is memory allocated: each rank's shards. The weights are then read from the
safetensors one tensor at a time; a 4-bit layer's weight is quantized on the rank (bitsandbytes'
``quantize_4bit``, the call ``Params4bit`` makes, so the codes are those of one process) and
the rank keeps its rows of the codes, absmax and nested absmax. At any moment a rank holds its
shards plus one layer's weight in full precision.

Everything that can be refused is refused on the meta model, before a weight is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bitsandbytes.functional as bnbF
import torch
from torch import nn

from tightfit.distributed.parallelize import shard_model
from tightfit.optim.dtensor import is_dtensor, local_tensor
from tightfit.qlora.coverage import coverage_notes
from tightfit.qlora.experts import expert_modules
from tightfit.qlora.prepare import PrepareInfo, add_lora, plan_step
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.qlora.quantize import linear4bit_layers, linear4bit_skeleton
from tightfit.qlora.shardable import ShardableLinear4bit, empty_shardable

__all__ = ["check_fsdp_model", "load_sharded", "source_key"]


def load_sharded(
    folder: str | os.PathLike[str],
    options: PrepareOptions,
    *,
    lora: LoraOptions | None,
    example: Mapping[str, Any] | None,
    device: torch.device,
    reshard_after_forward: bool = True,
    check: Callable[[nn.Module], None] | None = None,
    fsdp_offload: bool = False,
) -> nn.Module:
    """The QLoRA model of ``folder`` (a local HF causal LM, safetensors), FSDP2-sharded.

    Every rank calls it (a process group must exist); the RNG must be seeded as for
    :func:`tightfit.prepare` (LoRA's initial ``A`` is drawn from it). ``check`` (the caller's
    own refusals: sequence length, vocabulary) runs on the meta model. ``fsdp_offload``: the
    shards are allocated and loaded on the host and stay there (``shard_model(fsdp_offload=True)``,
    FSDP2's ``CPUOffloadPolicy``); the buffers go to ``device``. Returns the prepared,
    sharded model with ``model.tightfit_info``, as ``prepare`` + ``shard_model`` would.

    Raises:
        ValueError / FileNotFoundError: a model or option FSDP2 cannot shard this way (said
            which and why), before any weight is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    files = _safetensors_files(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    cdtype = options.torch_compute_dtype(device)
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    check_fsdp_model(model, options, lora)
    if check is not None:
        check(model)
    base_numel = sum(p.numel() for p in model.parameters())
    if lora is not None or options.quant is not None:
        for p in model.parameters():  # prepare's rule: no adapters, no 4 bits: the base trains
            p.requires_grad_(False)
    quantized: list[str] = []
    if options.quant is not None:
        quantized = linear4bit_skeleton(model, quant_type=options.quant,
                                        double_quant=options.double_quant,
                                        compute_dtype=cdtype)  # fmt: skip
    if lora is not None:
        # a full-precision frozen linear on meta would pull its new adapter onto meta (peft
        # moves adapters to their base weight's device): a CPU placeholder while peft wraps,
        # of the dtype prepare's base has by then (peft casts adapters to it, as there)
        stashed = {} if quantized else _placeholder_weights(model, cdtype)
        model = add_lora(model, lora, _lora_targets(model, lora, quantized), [], cdtype)
        for layer, weight in stashed.items():
            layer.weight = weight
    adapted = [n.removeprefix("base_model.model.") for n, m in model.named_modules()
               if hasattr(m, "lora_A")]  # fmt: skip
    if options.loss_chunks is not None:
        from tightfit.loss import enable_chunked_loss

        enable_chunked_loss(model, chunk_tokens=options.loss_chunks)  # type: ignore[arg-type]
    for _, layer in list(linear4bit_layers(model)):
        empty_shardable(layer, blocksize=options.blocksize)
    shard_model(model, "fsdp", reshard_after_forward=reshard_after_forward, device=device,
                fsdp_offload=fsdp_offload)
    real = _materialize(model, device, fsdp_offload=fsdp_offload)
    _load_weights(model, files, cdtype, skip=real)
    info = PrepareInfo(options, lora, device, cdtype, quantized=quantized, adapted=adapted,
                       base_numel=base_numel)  # fmt: skip
    info.loss_chunks = options.loss_chunks
    info.notes += coverage_notes(model, quantized=options.quant is not None,
                                 adapted=lora is not None)  # fmt: skip
    plan_step(model, info, example)
    model.tightfit_info = info  # type: ignore[assignment]
    return model


def check_fsdp_model(model: nn.Module, options: PrepareOptions, lora: LoraOptions | None) -> None:
    """Refuse, on the meta model, what :func:`load_sharded` cannot shard (which and why)."""
    if options.resident_layers not in ("all", "auto"):
        raise ValueError(
            f"--resident-layers {options.resident_layers} cannot apply under --fsdp: FSDP2 "
            "shards the 4-bit base across the ranks and gathers one block at a time, and "
            "paging the base to the next tier is not supported under --fsdp; drop "
            "--resident-layers (or pass 'all'), or add GPUs (tightfit plan --gpus N), or "
            "train without --fsdp to page the base")
    experts = expert_modules(model)
    if experts:
        name = experts[0][0]
        why = ("its 4-bit expert stacks keep their constants as buffers, which FSDP2 does not "
               "cut, and " if options.quant is not None else "")
        raise ValueError(
            f"--fsdp cannot load this model's MoE experts ({name}, "
            f"{type(experts[0][1]).__name__}) shard by shard: {why}transformers fuses the "
            "checkpoint's per-expert weights into 3-D stacks as it loads (renamed keys, "
            "concatenated and stacked tensors), which tightfit's sharded loader does not do; "
            "train it without --fsdp (one process, or DDP replicas under torchrun)")
    from transformers.pytorch_utils import Conv1D

    if options.quant is None and lora is not None and any(
            isinstance(m, Conv1D) for m in model.modules()):  # fmt: skip
        raise ValueError(
            "--fsdp --quant none cannot load this model's GPT-2 Conv1D layers shard by shard "
            "(peft sizes their adapters from the weight, which is not loaded yet); quantize "
            "them (--quant nf4) or drop --fsdp")
    if lora is not None and lora.target_modules != "all-linear":
        names = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        if not set(lora.target_modules) & names:
            raise ValueError(
                f"LoRA target_modules {lora.target_modules!r} match no linear layer; they are "
                f"named {sorted(names)[:12]}; pass some of these or 'all-linear'."
            )


def source_key(name: str) -> str:
    """The safetensors key of a parameter of the prepared model (peft's prefixes removed)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@contextmanager
def _params_on_meta() -> Iterator[None]:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) for real
        yield


def _safetensors_files(folder: Path) -> list[Path]:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; pass a local Hugging "
                                "Face model folder saved with safetensors")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"--fsdp loads each rank's shards from safetensors, and {str(folder)!r} has none "
            "(a .bin checkpoint?); save the model with save_pretrained(safe_serialization=True)"
        )
    return files


def _lora_targets(model: nn.Module, lora: LoraOptions, quantized: list[str]) -> list[str]:
    """The layers LoRA adapts on the meta model: those of ``tightfit.prepare``, in its order."""
    if lora.target_modules != "all-linear":
        return list(lora.target_modules)
    return quantized or [n for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) and not n.endswith("lm_head")]  # fmt: skip


def _placeholder_weights(model: nn.Module, dtype: torch.dtype) -> dict[nn.Module, nn.Parameter]:
    """Swap each frozen ``nn.Linear``'s meta weight for an empty CPU one; the meta ones."""
    stashed = {}
    for _, m in model.named_modules():
        if type(m) is nn.Linear and m.weight.is_meta:
            stashed[m] = m.weight
            m.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    return stashed


def _materialize(model: nn.Module, device: torch.device, *, fsdp_offload: bool = False) -> set[str]:
    """Allocate this rank's shards (``to_empty``; on the host under ``fsdp_offload``, where
    FSDP2's ``CPUOffloadPolicy`` keeps them, the buffers still on ``device``), keeping what
    was real: LoRA and buffers; the names of those kept (the rest is read from the checkpoint)."""
    kept = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_meta:
            kept[name] = local_tensor(t).detach().clone()
    model.to_empty(device=torch.device("cpu") if fsdp_offload else device)
    if fsdp_offload:  # the code books and rotary tables are read on the device by every forward
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(device)
    current = dict([*model.named_parameters(), *model.named_buffers()])
    with torch.no_grad():
        for name, value in kept.items():
            local_tensor(current[name]).copy_(value)
    return set(kept)


def _load_weights(model: nn.Module, files: list[Path], cdtype: torch.dtype, *,
                  skip: set[str]) -> None:
    """Every meta-born tensor (all but ``skip``'s) from the safetensors: one full tensor at a
    time, this rank's rows kept."""
    from safetensors import safe_open

    where = {}
    for f in files:
        with safe_open(str(f), "pt") as reader:
            where.update({k: f for k in reader.keys()})  # noqa: SIM118 (not a dict)
    layers = dict(linear4bit_layers(model))
    done: set[str] = set()

    def read(key: str) -> torch.Tensor:
        if key not in where:
            raise ValueError(f"the checkpoint has no tensor {key!r}, which the model needs; "
                             "is the folder's config.json the one its weights were saved with?")
        with safe_open(str(where[key]), "pt") as reader:
            return reader.get_tensor(key)

    with torch.no_grad():
        for name, layer in layers.items():
            assert isinstance(layer, ShardableLinear4bit)
            _load_4bit(layer, read(source_key(name + ".weight")))
            done |= {f"{name}.{p}" for p in layer._parameters}
            if layer.bias is not None:
                _copy_rows(layer.bias, read(source_key(name + ".bias")).to(cdtype))
        for name, p in model.named_parameters():
            if name in done or name in skip:
                continue
            full = read(source_key(name))
            _copy_rows(p, full.to(cdtype) if full.is_floating_point() else full)


def _load_4bit(layer: ShardableLinear4bit, weight: torch.Tensor) -> None:
    """Quantize one layer's full weight as ``Params4bit`` does and keep this rank's rows."""
    if layer.transposed:  # GPT-2's Conv1D holds [in, out]
        weight = weight.t()
    device = layer.quant_map.device
    codes, qs = bnbF.quantize_4bit(
        weight.to(torch.float32).contiguous().to(device), blocksize=layer.blocksize,
        compress_statistics=layer.nested, quant_type=layer.quant_type,
        quant_storage=torch.uint8,
    )  # fmt: skip
    _copy_rows(layer.weight, codes)
    _copy_rows(layer.absmax, qs.absmax)
    layer.quant_map.copy_(qs.code)
    if layer.nested:
        _copy_rows(layer.nested_absmax, qs.state2.absmax)
        layer.nested_code.copy_(qs.state2.code)
        layer.nested_offset.copy_(torch.as_tensor(qs.offset))


def _copy_rows(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's dim-0 shard of ``full`` into ``param`` (FSDP2's cut: torch.chunk)."""
    local = local_tensor(param)
    if not is_dtensor(param):
        local.copy_(full.reshape(local.shape))
        return
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} does not fit the parameter "
                         f"of shape {tuple(param.shape)}")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    chunks = torch.chunk(full, world, dim=0)
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    local.copy_(mine.to(local.device, local.dtype))
