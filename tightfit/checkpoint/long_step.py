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
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from tightfit.checkpoint.api import disable, enable
from tightfit.checkpoint.cost import predict
from tightfit.checkpoint.extrapolate import crop, example_length, profile_from_crops
from tightfit.checkpoint.plan import OffloadMode, Plan, structural_segments
from tightfit.checkpoint.profile import profile
from tightfit.checkpoint.solver import min_peak
from tightfit.checkpoint.tile_cost import Base, predict_mlp_bytes
from tightfit.checkpoint.tiling import Tiling, disable_tiling, enable_tiling, tiling_of
from tightfit.loss import (
    auto_chunk_tokens,
    disable_chunked_loss,
    enable_chunked_loss,
    head_kind_of,
    is_chunked_loss_enabled,
    logit_transform_of,
)
from tightfit.measure.sizes import format_bytes
from tightfit.tiers.spill import check_spill_dir

CROP_TOKENS = 2048  # tokens of a step (batch × sequence) in the longer crop of a long example
MIN_CROP_TOKENS = 64
TILE_SHARE = 8  # a tile may add at most 1/8 to the smallest backward peak of the tiled MLP
MIN_TILE = 64  # tiles below this many tokens make inefficient matmuls (tiling's own floor)
MARGIN_FRACTION = 0.05  # of the device's memory, kept free beside the plan (fragmentation)
# and a fixed part per device type: on CUDA the allocator's rounding and split segments, cuBLAS
# workspaces and kernels' scratch; on the CPU (the C heap with a fixed mmap threshold,
# tightfit.measure.heap) the autograd graph's small objects and the heap's own slack, which
# benchmarks/results/long_context_cgroup.md measures under a memory cgroup
MARGIN_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}
_MIB = 1 << 20


@dataclass(frozen=True)
class Room:
    """Bytes a step could add on its device, and what bounds them, for messages ("the
    memory cgroup's limit (1.00 GiB) less the 412 MiB this process uses");
    :func:`tightfit.pressure.room.machine_room` returns it."""

    bytes: int
    limit: str


@dataclass(frozen=True)
class Adapters:
    """What the MLP tile predictor needs to know of the layers it tiles."""

    lora_rank: int = 0  # 0: no adapters
    lora_dropout: float = 0.0
    base: Base = "frozen"  # "4bit", "frozen" or "trainable"


@dataclass
class ActivationPlan:
    """What :func:`plan_activations` installed on the model.

    Attributes:
        plan: The checkpoint plan (``None``: checkpointing off).
        tiling: The tiled MLPs (``None``: untiled).
        loss_chunks: Tokens per loss chunk sized for a long step (``None``: the chunk the
            model had is kept).
        notes: Anything the caller should know (a fallback, the long-context route taken).
    """

    plan: Plan | None = None
    tiling: Tiling | None = None
    loss_chunks: int | None = None
    notes: list[str] = field(default_factory=list)


def check_inputs(model: nn.Module, example: Any, offload_dir: str | None) -> None:
    """Refuse an activation spill folder that cannot be written and an example longer than
    the model's position limit, before anything changes."""
    check_spill_dir(offload_dir)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if example is None or not isinstance(limit, int):
        return
    length = example_length(example)
    if length > limit:
        raise ValueError(f"the example's sequences are {length} tokens, longer than the model's "
                         f"position limit ({limit} positions, config.max_position_embeddings); "
                         f"pass sequences of at most {limit} tokens.")


def plan_activations(model: nn.Module, example: Any, dev: torch.device, *,
                     checkpoint: str | None, checkpoint_budget: int | None,
                     offload: OffloadMode, offload_host_budget: int | None, offload_dir: str | None,
                     mlp_tile: int | Literal["auto"] | None,
                     loss_chunks: int | Literal["auto"] | None,
                     compute_dtype: torch.dtype, adapters: Adapters, room: Room) -> ActivationPlan:
    """Install the checkpoint plan (with offload, tiles and a loss chunk when a long step
    needs them) and say what was installed.

    Args:
        model: The prepared model (its loss already chunked when ``loss_chunks`` asks it).
        example: A batch of the run's shape (``None``: fixed policies only).
        dev: Where the model lives.
        checkpoint, checkpoint_budget, offload, offload_host_budget, offload_dir, mlp_tile,
            loss_chunks: As :class:`tightfit.PrepareOptions` names them.
        compute_dtype: The dtype of the matmuls.
        adapters: The LoRA adapters on the layers (for the MLP tile's prediction).
        room: Bytes a step could add on ``dev`` now, and what bounds them
            (:func:`tightfit.pressure.room.machine_room`).
    """
    # prepare returns the model to train, and a plan is profiled on a training step: in eval
    # mode (from_pretrained's) the chunked loss also returns the full logits and the profile
    # would price a step that training never runs
    model.train()
    out = ActivationPlan()
    if isinstance(mlp_tile, int):
        out.tiling = enable_tiling(model, mlp_tile)
    policy = checkpoint
    if policy in (None, "none") and offload != "all":
        return out
    policy = policy or "none"
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False):
        cfg.use_cache = False  # a KV cache is for generation; recompute would write it twice
    example = _move_example(example, dev)
    if isinstance(example, Mapping) and "labels" not in example:
        example = {**example, "labels": example["input_ids"]}
    tier = {"offload": offload, "offload_host_budget": offload_host_budget,
            "offload_dir": offload_dir}
    if policy != "budget":
        out.plan = enable(model, policy, example=example, **tier)
    elif example is None:
        out.notes.append("checkpoint='budget' needs an example batch; used 'sqrt' instead.")
        out.plan = enable(model, "sqrt", **tier)
    else:
        long = _LongStep(model, example, dev, out, tier, mlp_tile=mlp_tile,
                         loss_chunks=loss_chunks, compute_dtype=compute_dtype,
                         adapters=adapters)
        out.plan = long.budget_plan(checkpoint_budget, room)
    return out


def _move_example(example: Any, dev: torch.device) -> Any:
    if isinstance(example, torch.Tensor):
        return example.to(dev)
    if isinstance(example, Mapping):
        return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in example.items()}
    return example


@dataclass
class _LongStep:
    """The ``"budget"`` policy on one example: today's plan when it fits, else the
    long-context escalation (tiles, a sized loss chunk, crops, offload)."""

    model: nn.Module
    example: Any
    dev: torch.device
    out: ActivationPlan
    tier: dict[str, Any]  # offload, offload_host_budget, offload_dir: checkpoint.enable's keywords
    mlp_tile: int | Literal["auto"] | None
    loss_chunks: int | Literal["auto"] | None
    compute_dtype: torch.dtype
    adapters: Adapters

    def budget_plan(self, checkpoint_budget: int | None, room: Room) -> Plan:
        model, example, dev = self.model, self.example, self.dev
        capacity, source = checkpoint_budget, "checkpoint_budget"
        if capacity is None and dev.type == "cuda":
            capacity, source = step_capacity(model, dev, room), f"of {room.limit}"
        # a profile runs the step unchecked: it must fit the room less the margin, as the step
        # does (under a memory cgroup a pass that reaches the limit is killed, not refused)
        usable = usable_room(room, dev)
        crops, ext = _crops(model, example, usable)
        fits_machine = ext is None or ext.peak_bytes <= usable
        if capacity is None and not fits_machine:
            capacity, source = step_capacity(model, dev, room), f"of {room.limit}"
        if capacity is None:
            return self._halfway()  # the CPU without a budget
        plain = profile(model, example) if fits_machine else ext
        lowest = min_peak(plain)
        if lowest <= capacity or (self.mlp_tile != "auto" and self.loss_chunks != "auto"):
            # the plain model fits (or there is nothing to add): the plan it always had
            budget = capacity
            if checkpoint_budget is None:
                budget = min(capacity, _halfway_budget(plain, self.out.notes))
            return enable(model, "budget", budget=budget, profiled=plain, **self.tier)
        return self._long_plan(capacity=capacity, source=source, lowest=lowest,
                               crops=None if fits_machine else crops)

    def _halfway(self) -> Plan:
        none_plan = enable(self.model, "none", example=self.example)
        disable(self.model)
        profiled = none_plan.profile  # profile once: the budget plan reuses it
        budget = _halfway_budget(profiled, self.out.notes)
        return enable(self.model, "budget", budget=budget, example=self.example,
                      profiled=profiled, **self.tier)

    def _long_plan(self, *, capacity: int, source: str, lowest: int,
                   crops: tuple[int, int] | None) -> Plan:
        """Tile the MLPs, size the loss chunk to ``capacity``, profile, and let the solver
        offload; the model is left as it was when no plan fits."""
        model, example, out = self.model, self.example, self.out
        rows, length = (int(n) for n in example["input_ids"].shape[:2])
        cap = crops[0] * rows if crops is not None else rows * length  # the shorter crop's
        tile = self._choose_tile(rows * length, cap // 2) if self.mlp_tile == "auto" else None
        chunk = choose_chunk(model, self.compute_dtype, length, rows, capacity, cap) \
            if self.loss_chunks == "auto" and is_chunked_loss_enabled(model) else None
        tried = []
        try:
            if tile is not None:
                out.tiling = enable_tiling(model, tile)
                tried.append(f"MLPs tiled in {tile} tokens")
            if chunk is not None:
                enable_chunked_loss(model, chunk)
                tried.append(f"loss in chunks of {chunk} tokens")
            prof = profile(model, example) if crops is None else \
                profile_from_crops(model, example, crops)
            plan = enable(model, "budget", budget=capacity, profiled=prof, **self.tier)
        except ValueError as e:
            if tile is not None:
                disable_tiling(model)
                out.tiling = tiling_of(model)
            if chunk is not None:
                disable_chunked_loss(model)
                enable_chunked_loss(model, self.loss_chunks)  # type: ignore[arg-type]
            offload = self.tier["offload"]
            raise ValueError(f"the smallest plan of the plain model needs "
                             f"{format_bytes(lowest)}, above the {format_bytes(capacity)} the "
                             f"step may use ({source}); with "
                             f"{', '.join(tried + [f'offload={offload}'])}: {e}") from e
        if chunk is not None:
            out.loss_chunks = chunk
        profiled = ("profiled at full length" if crops is None else
                    f"profile carried from crops of {crops[0]} and {crops[1]} tokens")
        out.notes.append(
            f"long context: the plain model's smallest plan needs {lowest / _MIB:.1f} MiB, "
            f"above the {capacity / _MIB:.1f} MiB a step may use ({source}); so "
            f"{', '.join(tried)} and offload={self.tier['offload']} ({profiled}): predicted "
            f"peak {plan.predicted_peak_bytes / _MIB:.1f} MiB, "
            f"{sum(s.offloads for s in plan.segments)} segments offloaded, "
            f"{plan.host_bytes / _MIB:.1f} MiB on the next tier")
        return plan

    def _choose_tile(self, tokens: int, largest: int) -> int | None:
        """The MLP tile (tokens) for a step of ``tokens``: the largest of at most ``largest``
        and the hidden size whose predicted MLP backward is within ``1 / TILE_SHARE`` of the
        smallest any tile reaches (halving from there, at least ``MIN_TILE``); ``None`` when
        the model's MLPs cannot be tiled or predicted."""
        cfg = getattr(self.model, "config", None)
        hidden = getattr(cfg, "hidden_size", None)
        inter = getattr(cfg, "intermediate_size", None)
        if not isinstance(hidden, int) or not isinstance(inter, int):
            self.out.notes.append("long context: the MLPs are not tiled (no hidden_size / "
                                  "intermediate_size in the model's config)")
            return None
        a = self.adapters
        kw = {"lora_rank": a.lora_rank, "lora_dropout": a.lora_dropout, "base": a.base}
        tile = max(MIN_TILE, min(hidden, largest, tokens))
        try:
            floor = predict_mlp_bytes(tokens, hidden, inter, self.compute_dtype, tile=MIN_TILE,
                                      **kw).backward_peak_bytes
            while tile // 2 >= MIN_TILE and predict_mlp_bytes(
                    tokens, hidden, inter, self.compute_dtype, tile=tile,
                    **kw).backward_peak_bytes > floor * (1 + 1 / TILE_SHARE):
                tile //= 2
        except ValueError as e:  # a combination tile_cost does not model: the largest tile
            self.out.notes.append(f"long context: MLP tile not predicted ({e}); {tile} tokens")
        return tile


def _halfway_budget(prof: Any, notes: list[str]) -> int:
    """No budget given: halfway between the smallest peak any plan reaches and no
    checkpointing, so the plan saves memory at a fraction of every-layer recompute."""
    lowest = int(min_peak(prof))
    none_peak = predict(prof, structural_segments("none", None, len(prof.blocks))).peak_bytes
    budget = lowest + (int(none_peak) - lowest) // 2
    notes.append(f"checkpoint budget: halfway between the smallest plan's peak "
                 f"({lowest / _MIB:.1f} MiB) and no checkpointing ({none_peak / _MIB:.1f} MiB) = "
                 f"{budget / _MIB:.1f} MiB")
    return budget


def step_margin(total: int, dev: torch.device) -> int:
    """Bytes kept free beside a long step's plan of ``total`` bytes of room on ``dev``
    (fragmentation, what the plan does not see); ``tightfit train``'s preflight keeps the same."""
    return int(MARGIN_FRACTION * total + MARGIN_BYTES.get(dev.type, MARGIN_BYTES["cuda"]))


def usable_room(room: Room, dev: torch.device) -> int:
    """What of ``room`` a step (or a profiling pass of one) may take: less the margin."""
    return max(0, room.bytes - step_margin(room.bytes, dev))


def step_capacity(model: nn.Module, dev: torch.device, room: Room) -> int:
    """What a step's activations may take of ``room``: less the gradients and an AdamW state
    of the trainable parameters (made after prepare) and a margin.

    Raises:
        ValueError: nothing is left (the message names the limit and each part).
    """
    trainable = sum(p.numel() * (p.element_size() + 8) for p in model.parameters()
                    if p.requires_grad)
    total = room.bytes
    if dev.type == "cuda":
        total = torch.cuda.mem_get_info(dev)[1]
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        total = int(total * (fraction(dev) if callable(fraction) else 1.0))
    margin = step_margin(total, dev)
    capacity = room.bytes - trainable - margin
    if capacity <= 0:
        raise ValueError(f"no room is left for a step's activations: {room.limit} leaves "
                         f"{format_bytes(room.bytes)}, and the trainable parameters' gradients "
                         f"and optimizer state take {format_bytes(trainable)} beside a margin of "
                         f"{format_bytes(margin)}; free memory or raise the limit, or train a "
                         "smaller model.")
    return capacity


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


def choose_chunk(model: nn.Module, compute_dtype: torch.dtype, length: int, rows: int,
                 capacity: int, largest: int) -> int:
    """Tokens per loss chunk under the activation ``capacity`` (``loss_chunks="auto"``'s
    rule with ``activation_budget=``), at most ``largest``."""
    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    head = lm.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or lm.config.vocab_size
    chunk = auto_chunk_tokens(vocab, length, rows, compute_dtype, head_kind=head_kind_of(head),
                              softcap=logit_transform_of(lm).softcap is not None,
                              activation_budget=capacity)
    return max(1, min(chunk, largest))
