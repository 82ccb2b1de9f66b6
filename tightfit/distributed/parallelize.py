"""Wrap a model for data parallelism: FSDP2 (sharded) or DDP (replicated).

FSDP2 is applied torchtitan-style: ``fully_shard`` on every transformer block, then on the root,
so each block's parameters are gathered just before it runs and freed after. Blocks are found
by the checkpoint planner's :func:`~tightfit.model.blocks.find_blocks` (the decoder layers
of every HF causal LM, wrapped by peft or not).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from tightfit.model.blocks import find_blocks
from tightfit.qlora.quantize import linear4bit_layers
from tightfit.qlora.shardable import make_shardable

__all__ = ["Strategy", "find_blocks", "shard_model", "shards_on_host", "unshardable"]

Strategy = Literal["fsdp", "ddp"]


def shard_model(
    model: nn.Module,
    strategy: Strategy,
    *,
    blocks: list[nn.Module] | None = None,
    reshard_after_forward: bool = True,
    shard_frozen: bool = True,
    device: torch.device | None = None,
    fsdp_offload: bool = False,
) -> nn.Module:
    """Make ``model`` data-parallel over the default process group.

    Args:
        model: the model, already on this rank's device, identical on every rank (or each
            rank's shards already in place: :mod:`tightfit.distributed.sharded_load`).
        strategy: ``"fsdp"``: FSDP2, parameters become DTensors sharded on dim 0 (in place;
            the same module is returned). ``"ddp"``: ``DistributedDataParallel`` replicas
            (a wrapper is returned; its ``.module`` is ``model``).
        blocks: modules to shard one by one under FSDP2; found by :func:`find_blocks` if None.
        reshard_after_forward: FSDP2: free each block's gathered params after its forward
            (ZeRO-3) or keep them to backward (ZeRO-2: every block's gathered at once by the
            end of forward). Forced on for blocks with frozen params when ``shard_frozen``:
            ZeRO-2 would gather the whole frozen base on every rank.
        shard_frozen: FSDP2: shard the params that do not require grad too: the frozen base,
            4-bit layers included (their codes, absmax and nested absmax become parameters,
            :func:`tightfit.qlora.shardable.make_shardable`). ``False`` leaves them
            replicated on every rank (``fully_shard(ignored_params=...)``).
        device: this rank's device (default: the model's); pass it for a model on meta.
        fsdp_offload: FSDP2: keep every sharded parameter, its gradient and so the optimizer
            step on the host (FSDP2's own ``CPUOffloadPolicy``, pinned on CUDA); a unit's
            shards are copied to ``device`` for its all-gather and the unsharded block lives
            there while it runs. The device then holds only what is gathered (the root and
            the blocks in flight), the buffers and the activations. ``tightfit train
            --fsdp --fsdp-offload``; what ``tightfit plan --gpus N`` adds when the shards
            alone leave too little room.

    Returns:
        The module to train and to hand to DCP's state-dict helpers.

    Raises:
        ValueError: on an unknown strategy, without an initialized process group, or with
            parameters FSDP2 cannot shard (:func:`unshardable`).
    """
    if strategy not in ("fsdp", "ddp"):
        raise ValueError(f"strategy={strategy!r} is not one of 'fsdp', 'ddp'")
    if not torch.distributed.is_initialized():
        raise ValueError(
            "no process group: launch with torchrun and call "
            "tightfit.distributed.launch.init_from_env() first"
        )
    device = device if device is not None else next(model.parameters()).device
    if strategy == "ddp" and fsdp_offload:
        raise ValueError("fsdp_offload applies to FSDP2's shards; DDP replicas keep the whole model "
                         "on each device: use strategy='fsdp' (tightfit train --fsdp)")
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    if shard_frozen:
        # refuse before any layer changes: the 4-bit weights converted below are let through
        problem = unshardable(model, converting=True)
        if problem is not None:
            raise ValueError(problem)
        for _, layer in list(linear4bit_layers(model)):
            make_shardable(layer)
    blocks = blocks if blocks is not None else find_blocks(model)
    _fully_shard_units(model, blocks, device, reshard_after_forward=reshard_after_forward,
                       shard_frozen=shard_frozen, fsdp_offload=fsdp_offload)  # fmt: skip
    _prefetch_one_ahead(blocks)
    return model


def _fully_shard_units(model: nn.Module, blocks: list[nn.Module], device: torch.device, *,
                       reshard_after_forward: bool, shard_frozen: bool, fsdp_offload: bool) -> None:
    """``fully_shard`` each block, the frozen untied embedding, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    # pinned host shards (their copy to the device can overlap); the CPU has nothing to pin
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp_offload else OffloadPolicy()

    def frozen(module: nn.Module) -> set[nn.Parameter] | None:
        return None if shard_frozen else {p for p in module.parameters() if not p.requires_grad}

    for block in blocks:
        has_frozen = any(not p.requires_grad for p in block.parameters())
        fully_shard(
            block, mesh=mesh, ignored_params=frozen(block),
            reshard_after_forward=reshard_after_forward or (shard_frozen and has_frozen),
            offload_policy=policy,
        )  # fmt: skip
    embed = _frozen_untied_embedding(model) if shard_frozen else None
    if embed is not None:  # used once, at the start: gathered for its lookup only
        fully_shard(embed, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    # the root (norm, head; the embeddings when tied) stays gathered from forward to
    # backward, which needs it at once; torchtitan does the same
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=frozen(model),
                offload_policy=policy)


def shards_on_host(model: nn.Module) -> bool:
    """Whether FSDP2 keeps every sharded parameter of ``model`` on the host
    (``shard_model(fsdp_offload=True)``); ``False`` when any stays on the device or none is sharded."""
    from torch.distributed.fsdp import FSDPModule

    flags = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 (torch's own)
            flags += [p.offload_to_cpu for p in (group.fsdp_params if group else [])]
    return bool(flags) and all(flags)


def _frozen_untied_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding, when it is frozen and not tied to the head (a unit of its own
    would split a parameter the root's head also uses)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embed is None or any(p.requires_grad for p in embed.parameters()):
        return None
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    return None if any(id(p) in head_params for p in embed.parameters()) else embed


def _prefetch_one_ahead(blocks: list[nn.Module]) -> None:
    """Gather block i+1 while block i computes (forward), block i-1 in backward."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])  # type: ignore[operator]
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])  # type: ignore[operator]


def unshardable(model: nn.Module, *, converting: bool = False) -> str | None:
    """Why FSDP2 cannot shard ``model``'s parameters, naming the first that it cannot
    (``None``: every one can), with the fix.

    FSDP2 shards plain tensors on dim 0. A bitsandbytes ``Params4bit`` left unconverted, an
    8-bit ``Int8Params`` or a 3-D packed MoE expert stack hold their constants outside the
    tensor, so a shard would lose them.

    Args:
        model: The model, unchanged.
        converting: Let through the quantized ``Params4bit`` weights of ``Linear4bit``
            layers, which :func:`~tightfit.qlora.shardable.make_shardable` turns into plain
            parameters (what :func:`shard_model` does once nothing is refused).
    """
    converted = set()
    if converting:
        converted = {id(layer.weight) for _, layer in linear4bit_layers(model)
                     if getattr(layer.weight, "quant_state", None) is not None}  # fmt: skip
    for name, p in model.named_parameters():
        if id(p) in converted:
            continue
        kind = type(p).__name__
        if kind in ("Params4bit", "Int8Params"):
            return (f"--fsdp cannot shard {name}: a bitsandbytes {kind} keeps its quantization "
                    "constants outside the tensor, where FSDP2 does not see them; quantize "
                    "linear layers with tightfit (NF4/FP4 Linear4bit), or drop --fsdp")
        if p.dim() == 0:
            return (f"--fsdp cannot shard {name}: a 0-dim parameter has no dim 0 to cut; "
                    "make it 1-dim, or drop --fsdp")
    return None
