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

__all__ = ["Strategy", "find_blocks", "shard_model"]

Strategy = Literal["fsdp", "ddp"]


def shard_model(
    model: nn.Module,
    strategy: Strategy,
    *,
    blocks: list[nn.Module] | None = None,
    reshard_after_forward: bool = True,
    shard_frozen: bool = False,
) -> nn.Module:
    """Make ``model`` data-parallel over the default process group.

    Args:
        model: the model, already on this rank's device, identical on every rank.
        strategy: ``"fsdp"``: FSDP2, parameters become DTensors sharded on dim 0 (in place;
            the same module is returned). ``"ddp"``: ``DistributedDataParallel`` replicas
            (a wrapper is returned; its ``.module`` is ``model``).
        blocks: modules to shard one by one under FSDP2; found by :func:`find_blocks` if None.
        reshard_after_forward: FSDP2: free gathered block params after forward (ZeRO-3) or
            keep them to backward (ZeRO-2, more memory, less communication).
        shard_frozen: FSDP2: also shard parameters that do not require grad. Off by default:
            QLoRA's frozen base is 4-bit (bitsandbytes ``Params4bit``, which FSDP2 cannot
            shard) and small; it stays replicated while the trainable LoRA params, their grads
            and their optimizer state are sharded.

    Returns:
        The module to train and to hand to DCP's state-dict helpers.

    Raises:
        ValueError: on an unknown strategy or without an initialized process group.
    """
    if strategy not in ("fsdp", "ddp"):
        raise ValueError(f"strategy={strategy!r} is not one of 'fsdp', 'ddp'")
    if not torch.distributed.is_initialized():
        raise ValueError(
            "no process group: launch with torchrun and call "
            "tightfit.distributed.launch.init_from_env() first"
        )
    device = next(model.parameters()).device
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))

    def frozen(module: nn.Module) -> set[nn.Parameter] | None:
        return None if shard_frozen else {p for p in module.parameters() if not p.requires_grad}

    for block in blocks if blocks is not None else find_blocks(model):
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard_after_forward,
            ignored_params=frozen(block),
        )  # fmt: skip
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=frozen(model)
    )
    return model
