"""The activation plan :func:`tightfit.prepare` installs: checkpoint, offload, tiled MLP, loss chunk.

Short steps keep the plan they always had: the example is profiled as it is and the budget
solver (or the fixed policy) plans it. A step is planned for **long context** when a device
capacity is known and the smallest plan of the plain model (every layer recomputed, nothing
offloaded, the MLP untiled) does not fit it. The capacity is the ``checkpoint_budget`` when
one is given; on CUDA, else, the memory free after the weights less what the gradients, the
optimizer state and a margin will take; on the CPU, else, only when the unchecked step would
not even fit the machine (a memory cgroup's limit, or the RAM available), that room the same
way. Then:

1. every layer's MLP runs in tiles (:mod:`tightfit.checkpoint.tiling`) with ``mlp_tile="auto"``,
   the tile chosen by :func:`tightfit.checkpoint.tile_cost.predict_mlp_bytes`: the largest
   (fewest tiles) whose MLP backward is within ``1 / TILE_SHARE`` of the smallest any tile
   reaches;
2. with ``loss_chunks="auto"`` the LM head + loss chunk is sized to the capacity
   (:func:`tightfit.loss.auto_chunk_tokens` with ``activation_budget=``), fixed for the run;
3. the example is profiled at its full length only when that unchecked step fits the
   machine; else on two crops of it, carried to the full length
   (:mod:`tightfit.checkpoint.extrapolate`; crops of up to ``CROP_TOKENS`` tokens, so the tile
   is at most half and the chunk at most all of the shorter crop's tokens);
4. the budget solver plans for the capacity and may offload (``offload="auto"``).

A capacity no plan meets is refused with the smallest peak any plan reaches and the host
bytes it would need (the solver's error), saying what was tried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tightfit.checkpoint import enable, enable_tiling, profile, tiling_of
from tightfit.checkpoint.extrapolate import crop, example_length, profile_from_crops
from tightfit.checkpoint.plan import Plan
from tightfit.checkpoint.solver import min_peak
from tightfit.qlora.prepare_options import PrepareOptions
from tightfit.tiers.regions import meminfo

CROP_TOKENS = 2048  # tokens of a step (batch × sequence) in the longer crop of a long example
MIN_CROP_TOKENS = 64
TILE_SHARE = 8  # a tile may add at most 1/8 to the smallest backward peak of the tiled MLP
MIN_TILE = 64  # tiles below this many tokens make inefficient matmuls (tiling's own floor)
MARGIN_FRACTION = 0.05  # of the device's memory, kept free beside the plan (fragmentation)
MARGIN_BYTES = 256 << 20
_MIB = 1 << 20


def check_inputs(model: nn.Module, options: PrepareOptions, example: Any) -> None:
    """Refuse an activation spill folder that cannot be written and an example longer than
    the model's position limit, before anything changes."""
    from tightfit.tiers.spill import check_spill_dir

    check_spill_dir(options.offload_dir)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if example is None or not isinstance(limit, int):
        return
    length = example_length(example)
    if length > limit:
        raise ValueError(f"the example's sequences are {length} tokens, longer than the model's "
                         f"position limit ({limit} positions, config.max_position_embeddings); "
                         f"pass sequences of at most {limit} tokens.")


def plan_activations(model: nn.Module, options: PrepareOptions, example: Any,
                     dev: torch.device, info: Any) -> Plan | None:
    """Install the checkpoint plan of ``options`` (with offload, tiles and chunk when a long
    step needs them) and return it; ``info`` (a ``PrepareInfo``) gets the tiling, the loss
    chunk and notes."""
    # prepare returns the model to train, and a plan is profiled on a training step: in eval
    # mode (from_pretrained's) the chunked loss also returns the full logits and the profile
    # would price a step that training never runs
    model.train()
    if isinstance(options.mlp_tile, int):
        info.tiling = enable_tiling(model, options.mlp_tile)
    policy = options.checkpoint
    if policy in (None, "none") and options.offload != "all":
        return None
    policy = policy or "none"
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False):
        cfg.use_cache = False  # a KV cache is for generation; recompute would write it twice
    example = _move_example(example, dev)
    if isinstance(example, Mapping) and "labels" not in example:
        example = {**example, "labels": example["input_ids"]}
    tier = {"offload": options.offload, "host_budget": options.offload_host_budget,
            "spill_dir": options.offload_dir}
    if policy != "budget":
        return enable(model, policy, example=example, **tier)
    if example is None:
        info.notes.append("checkpoint='budget' needs an example batch; used 'sqrt' instead.")
        return enable(model, "sqrt", **tier)
    return _budget_plan(model, options, example, dev, info, tier)


def _move_example(example: Any, dev: torch.device) -> Any:
    if isinstance(example, torch.Tensor):
        return example.to(dev)
    if isinstance(example, Mapping):
        return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in example.items()}
    return example


def _budget_plan(model: nn.Module, options: PrepareOptions, example: Any, dev: torch.device,
                 info: Any, tier: dict[str, Any]) -> Plan:
    """The ``"budget"`` policy: today's plan when it fits, else the long-context escalation."""
    capacity, source = options.checkpoint_budget, "checkpoint_budget"
    room = machine_room(dev)
    if capacity is None and dev.type == "cuda":
        capacity, source = step_capacity(model, dev, room), "free CUDA memory"
    crops, ext = _crops(model, example, room)
    fits_machine = ext is None or ext.peak_bytes <= room
    if capacity is None and not fits_machine:
        capacity, source = step_capacity(model, dev, room), "the memory free on this machine"
    if capacity is None:
        return _halfway(model, example, info.notes, tier)  # the CPU without a budget
    plain = profile(model, example) if fits_machine else ext
    lowest = min_peak(plain)
    if lowest <= capacity or (options.mlp_tile != "auto" and options.loss_chunks != "auto"):
        # the plain model fits (or there is nothing to add): the plan it always had
        budget = capacity
        if options.checkpoint_budget is None:
            budget = min(capacity, _halfway_budget(plain, info.notes))
        return enable(model, "budget", budget=budget, profiled=plain, **tier)
    return _long_plan(model, options, example, info, tier,
                      capacity=capacity, source=source, lowest=lowest,
                      crops=None if fits_machine else crops)


def _halfway_budget(prof: Any, notes: list[str]) -> int:
    """No budget given: halfway between the smallest peak any plan reaches and no
    checkpointing, so the plan saves memory at a fraction of every-layer recompute."""
    from tightfit.checkpoint.cost import predict
    from tightfit.checkpoint.plan import structural_segments

    lowest = int(min_peak(prof))
    none_peak = predict(prof, structural_segments("none", None, len(prof.blocks))).peak_bytes
    budget = lowest + (int(none_peak) - lowest) // 2
    notes.append(f"checkpoint budget: halfway between the smallest plan's peak "
                 f"({lowest / _MIB:.1f} MiB) and no checkpointing ({none_peak / _MIB:.1f} MiB) = "
                 f"{budget / _MIB:.1f} MiB")
    return budget


def _halfway(model: nn.Module, example: Any, notes: list[str], tier: dict[str, Any]) -> Plan:
    from tightfit.checkpoint import disable

    none_plan = enable(model, "none", example=example)
    disable(model)
    profiled = none_plan.profile  # profile once: the budget plan reuses it
    budget = _halfway_budget(profiled, notes)
    return enable(model, "budget", budget=budget, example=example, profiled=profiled, **tier)


def machine_room(dev: torch.device) -> int:
    """Bytes a step could add on ``dev`` now: CUDA's free memory (the cached part included,
    within a per-process fraction when one is set); on the CPU the memory cgroup's room or
    the RAM available, whichever is smaller."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        room = free + torch.cuda.memory_reserved(dev) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if callable(fraction):
            room = min(room, int(fraction(dev) * total) - allocated)
        return int(room)
    from tightfit.pressure.probes import RSSProbe, cgroup_memory_limit

    rooms = [_mem_available()]
    limit = cgroup_memory_limit()
    if limit is not None:
        rooms.append(limit - RSSProbe().used_bytes())
    return max(0, min(rooms))


def _mem_available() -> int:
    if (available := meminfo().get("MemAvailable")) is not None:
        return available
    import psutil

    return int(psutil.virtual_memory().available)


def step_capacity(model: nn.Module, dev: torch.device, room: int) -> int:
    """What a step's activations may take of ``room``: less the gradients and an AdamW state
    of the trainable parameters (made after prepare) and a margin."""
    trainable = sum(p.numel() * (p.element_size() + 8) for p in model.parameters()
                    if p.requires_grad)
    total = room
    if dev.type == "cuda":
        total = torch.cuda.mem_get_info(dev)[1]
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        total = int(total * (fraction(dev) if callable(fraction) else 1.0))
    return max(1, int(room - trainable - MARGIN_FRACTION * total - MARGIN_BYTES))


def _crops(model: nn.Module, example: Any, room: int) -> tuple[tuple[int, int] | None, Any]:
    """For a long example: the crop lengths (tokens per sequence) and the full-length profile
    extrapolated from them; ``(None, None)`` for a short one (it is profiled as it is)."""
    if not isinstance(example, Mapping):
        return None, None
    rows, length = (int(n) for n in example["input_ids"].shape[:2])
    t2 = min(length // 2, CROP_TOKENS // rows)
    if t2 * rows < CROP_TOKENS // 2 or t2 < 2 * MIN_CROP_TOKENS // rows:
        return None, None
    # a probe sizes the crops so that their unchecked steps fit the room (its bytes per
    # token, constants included, bound the crops' from above)
    probe_len = max(1, t2 // 16)
    per_token = max(1.0, profile(model, crop(example, probe_len)).peak_bytes / probe_len)
    if per_token * length <= room:
        return (t2 // 2, t2), None  # even the full unchecked step fits: profile it as it is
    t2 = min(t2, int(room / per_token))
    if t2 < 2:
        raise ValueError(f"even a {probe_len}-token crop of the example needs "
                         f"{per_token * probe_len / _MIB:.1f} MiB unchecked, more than the "
                         f"{room / _MIB:.1f} MiB free to profile it; free memory or shorten "
                         "the sequences.")
    crops = (t2 // 2, t2)
    return crops, profile_from_crops(model, example, crops)


def _long_plan(model: nn.Module, options: PrepareOptions, example: Any, info: Any,
               tier: dict[str, Any], *, capacity: int, source: str, lowest: int,
               crops: tuple[int, int] | None) -> Plan:
    """Tile the MLPs, size the loss chunk to ``capacity``, profile, and let the solver
    offload; the model is left as it was when no plan fits."""
    from tightfit.checkpoint import disable_tiling
    from tightfit.loss import disable_chunked_loss, enable_chunked_loss, is_chunked_loss_enabled

    rows, length = (int(n) for n in example["input_ids"].shape[:2])
    cap = crops[0] * rows if crops is not None else rows * length  # the shorter crop's tokens
    tile = choose_tile(model, options, info, rows * length, cap // 2) \
        if options.mlp_tile == "auto" else None
    chunk = choose_chunk(model, info, length, rows, capacity, cap) \
        if options.loss_chunks == "auto" and is_chunked_loss_enabled(model) else None
    tried = []
    try:
        if tile is not None:
            info.tiling = enable_tiling(model, tile)
            tried.append(f"MLPs tiled in {tile} tokens")
        if chunk is not None:
            enable_chunked_loss(model, chunk)
            tried.append(f"loss in chunks of {chunk} tokens")
        prof = profile(model, example) if crops is None else profile_from_crops(model, example, crops)
        plan = enable(model, "budget", budget=capacity, profiled=prof, **tier)
    except ValueError as e:
        if tile is not None:
            disable_tiling(model)
            info.tiling = tiling_of(model)
        if chunk is not None:
            disable_chunked_loss(model)
            enable_chunked_loss(model, options.loss_chunks)  # type: ignore[arg-type]
        raise ValueError(f"the smallest plan of the plain model needs {lowest} bytes, above "
                         f"the {capacity} the step may use ({source}); with "
                         f"{', '.join(tried + [f'offload={options.offload}'])}: {e}") from e
    if chunk is not None:
        info.loss_chunks = chunk
    profiled = ("profiled at full length" if crops is None else
                f"profile carried from crops of {crops[0]} and {crops[1]} tokens")
    info.notes.append(
        f"long context: the plain model's smallest plan needs {lowest / _MIB:.1f} MiB, above "
        f"the {capacity / _MIB:.1f} MiB a step may use ({source}); so {', '.join(tried)} and "
        f"offload={options.offload} ({profiled}): predicted peak "
        f"{plan.predicted_peak_bytes / _MIB:.1f} MiB, {sum(s.offloads for s in plan.segments)}"
        f" segments offloaded, {plan.host_bytes / _MIB:.1f} MiB on the next tier")
    return plan


def choose_tile(model: nn.Module, options: PrepareOptions, info: Any, tokens: int,
                largest: int) -> int | None:
    """The MLP tile (tokens) for a step of ``tokens``: the largest of at most ``largest``
    and the hidden size whose predicted MLP backward is within ``1 / TILE_SHARE`` of the
    smallest any tile reaches (halving from there, at least ``MIN_TILE``); ``None`` when
    the model's MLPs cannot be tiled or predicted."""
    from tightfit.checkpoint.tile_cost import predict_mlp_bytes

    cfg = getattr(model, "config", None)
    hidden, inter = getattr(cfg, "hidden_size", None), getattr(cfg, "intermediate_size", None)
    if not isinstance(hidden, int) or not isinstance(inter, int):
        info.notes.append("long context: the MLPs are not tiled (no hidden_size / "
                          "intermediate_size in the model's config)")
        return None
    lora = info.lora
    kw = {"lora_rank": lora.r if lora is not None else 0,
          "lora_dropout": lora.dropout if lora is not None else 0.0,
          "base": "4bit" if options.quant else ("frozen" if lora is not None else "trainable")}
    tile = max(MIN_TILE, min(hidden, largest, tokens))
    try:
        floor = predict_mlp_bytes(tokens, hidden, inter, info.compute_dtype, tile=MIN_TILE,
                                  **kw).backward_peak_bytes
        while tile // 2 >= MIN_TILE and predict_mlp_bytes(
                tokens, hidden, inter, info.compute_dtype, tile=tile,
                **kw).backward_peak_bytes > floor * (1 + 1 / TILE_SHARE):
            tile //= 2
    except ValueError as e:  # a combination tile_cost does not model: the largest tile
        info.notes.append(f"long context: MLP tile not predicted ({e}); {tile} tokens")
    return tile


def choose_chunk(model: nn.Module, info: Any, length: int, rows: int, capacity: int,
                 largest: int) -> int:
    """Tokens per loss chunk under the activation ``capacity`` (``loss_chunks="auto"``'s
    rule with ``activation_budget=``), at most ``largest``."""
    from tightfit.loss import auto_chunk_tokens, head_kind_of, logit_transform_of

    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    head = lm.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or lm.config.vocab_size
    chunk = auto_chunk_tokens(vocab, length, rows, info.compute_dtype, head_kind=head_kind_of(head),
                              softcap=logit_transform_of(lm).softcap is not None,
                              activation_budget=capacity)
    return max(1, min(chunk, largest))
