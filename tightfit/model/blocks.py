"""Finding the chain of repeated blocks (decoder layers) a checkpoint plan cuts into segments.

Discovery is structural, not a table of model names: an ``nn.Sequential`` model is its own
chain; otherwise the chain is the ``nn.ModuleList`` (or nested ``nn.Sequential``) of two or
more modules of one class that holds the most parameters — the decoder layers of every
Hugging Face causal LM, wrapped by peft or not.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the chain of repeated blocks of ``model``, in forward order.

    Args:
        model: An ``nn.Sequential`` or a model holding its layers in an ``nn.ModuleList``.

    Returns:
        The blocks, e.g. ``list(model.model.layers)`` for a Hugging Face Llama.

    Raises:
        ValueError: No container of two or more same-class modules was found.
    """
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return list(model)
    best: list[nn.Module] | None = None
    best_params = -1
    for _, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1:
            continue
        params = sum(_param_count(c) for c in children)
        if params > best_params or (params == best_params and len(children) > len(best or [])):
            best, best_params = children, params
    if best is None or best_params == 0:
        raise ValueError(
            f"no chain of repeated blocks found in {type(model).__name__}: tightfit looks for an "
            "nn.Sequential or an nn.ModuleList of two or more same-class layers. Pass the "
            "blocks yourself, in forward order, e.g. blocks=list(model.layers)."
        )
    return best


def resolve_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[nn.Module]:
    """Check caller-given ``blocks`` (or discover them) and return them as a list.

    Raises:
        TypeError: An entry is not an ``nn.Module``.
        ValueError: A block is not a submodule of ``model``, is listed twice, or none found.
    """
    if blocks is None:
        return find_blocks(model)
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks=[] is empty; pass the model's layers in forward order.")
    for b in blocks:
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks must be nn.Module instances, got {type(b).__name__}.")
    ids = {id(m) for m in model.modules()}
    if any(id(b) not in ids for b in blocks):
        raise ValueError("every entry of blocks= must be a submodule of the model being planned.")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("blocks= lists a module twice; pass each layer once, in forward order.")
    return blocks
