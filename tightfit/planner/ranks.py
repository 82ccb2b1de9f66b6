"""One rank of N: the device bytes of a step under ``tightfit train --fsdp`` (or DDP).

``tightfit plan --gpus N`` plans each row for one rank of ``torchrun --nproc_per_node N``.
Under FSDP2 (:mod:`tightfit.distributed.parallelize`, the runtime this models) a rank holds:

* **its shards** (``weights``, ``constants``, ``lora``, ``grads``, ``optimizer``): every
  parameter is cut on dim 0 into ``ceil(rows / N)`` rows (FSDP2 pads the last shard), the
  4-bit base's packed codes, absmax and nested absmax included; the NF4 / double-quant code
  books (:data:`REPLICATED_CONSTANT_BYTES` a quantized linear) and the rotary tables are
  buffers, replicated; the optimizer pages the state of its shard only;
* **the gathered parameters** (``gathered``): the root unit (final norm and LM head, the
  embeddings too when tied) stays gathered from forward to the end of backward
  (``reshard_after_forward=False`` on the root); the decoder blocks, which all hold a frozen
  base in every ladder row, are ZeRO-3 whatever ``--zero3`` says (``shard_model`` forces
  ``reshard_after_forward=True`` for them: ZeRO-2 would gather the whole base by the end of
  forward), and each prefetches one block ahead, so :data:`GATHERED_BLOCKS` blocks' unsharded
  parameters (codes, constants, norms, LoRA) are in flight at once: the one computing and
  the next one's all-gather output;
* **communication buffers** (``comm``): the reduce-scatter input of a block's gradients (a
  copy of its unsharded LoRA grads, held until the next reduce-scatter is issued) beside the
  grads of the block in backward, which ``grads`` counts. Source: torch 2.13's
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` (``foreach_all_gather``
  allocates the all-gather output, world size x the padded shard, freed once copied out;
  ``foreach_reduce`` allocates ``reduce_scatter_input`` of the unsharded grads) and
  ``_fsdp_param_group.py`` (``AllGatherState`` / ``ReduceScatterState``: each buffer is
  kept until the next collective of its kind is issued, instead of ``record_stream``);
* **activations** of its own rows: ``tightfit train``'s ``--batch-size`` is the global batch,
  a rank trains on ``batch / N`` of it.

With ``setup.fsdp_offload`` (``tightfit train --fsdp --fsdp-offload``: FSDP2's
``CPUOffloadPolicy`` on every unit) the shards, their grads and the optimizer state are the
host's (``host_weights``, ``optimizer_offloaded``): the device keeps the buffers, the gathered
units, the unsharded grads of the block in backward, one block's shard copied over as its
all-gather input (``comm``) and the activations.

The step's peak is the larger of two moments: the activation peak in backward (shards +
root + two blocks + activations), and the start of forward, where an untied frozen input
embedding (a unit of its own, gathered for its lookup only) is gathered beside the root with
its all-gather output (shards + root + 2 x embedding; tied: 2 x root) while activations are
still small.

A configuration FSDP2 cannot shard (:func:`ddp_only`: MoE experts, which transformers
fuses from the checkpoint's per-expert tensors as it loads and which 4-bit keeps with their
constants as buffers, neither of which the sharded loader does; the LLM.int8 base) runs under DDP:
every rank holds the whole model, and DDP's gradient buckets a second copy of the grads
(``DistributedDataParallel(gradient_as_bucket_view=False)``, torch's default: "the saved
memory size will be equal to the total gradients size" when it is True).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tightfit.planner.estimate import (
    DQ_CODE_BYTES,
    NF4_CODE_BYTES,
    Estimate,
    Overhead,
    base_weight_bytes,
    estimate,
    lora_param_count,
    optimizer_state_bytes,
    rotary_buffer_bytes,
)
from tightfit.planner.presets import ModelShape
from tightfit.planner.train_setup import TrainSetup

# The decoder blocks' unsharded parameters a rank holds at once: the block computing and
# the next one arriving (forward prefetch / backward prefetch, one block ahead:
# parallelize._prefetch_one_ahead), whose all-gather output is its unsharded bytes.
GATHERED_BLOCKS = 2
# The fewest-GPUs search stops here (a model that fits no number of GPUs up to it).
MAX_GPUS = 64


def step_estimate(shape: ModelShape, setup: TrainSetup, overhead: Overhead,
                  gpus: int = 1) -> Estimate:
    """The memory model's bytes of ``setup`` on one device
    (:func:`~tightfit.planner.estimate.estimate`), or on one rank of ``gpus``
    (:func:`rank_estimate`; ``setup.batch_size`` is the rank's rows)."""
    if gpus == 1:
        return estimate(shape, setup, overhead)
    return rank_estimate(shape, setup, overhead, gpus)


def replicated_constant_bytes(double_quant: bool) -> int:
    """The buffers of a 4-bit linear FSDP2 does not shard: the 16-entry NF4 code book, and
    with double quant the 256-entry nested code book and its offset (1,092 bytes,
    :data:`tightfit.qlora.shardable.REPLICATED_BYTES`)."""
    return NF4_CODE_BYTES + (DQ_CODE_BYTES + 4 if double_quant else 0)


def check_gpus(gpus: object) -> int:
    """``gpus`` as a number of ranks, or a ``ValueError`` naming the fix."""
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise ValueError(f"gpus must be a whole number of GPUs (ranks), got {gpus!r}; e.g. "
                         "gpus=2 (tightfit plan --gpus 2).")
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: a plan needs at least one GPU; pass gpus=1 (the "
                         "default) or more.")
    return gpus


def global_batch(batch_size: int, gpus: int) -> int:
    """The global batch a plan on ``gpus`` GPUs runs: ``batch_size``, a multiple of ``gpus``
    (tightfit train splits ``--batch-size`` over the ranks); ``1`` (the default) on more GPUs
    is one sequence per GPU.

    Raises:
        ValueError: a batch that does not split evenly, naming the nearest that do.
    """
    if gpus == 1 or batch_size % gpus == 0:
        return batch_size
    if batch_size == 1:
        return gpus
    lower, upper = batch_size // gpus * gpus, (batch_size // gpus + 1) * gpus
    near = f"{lower} or {upper}" if lower else f"{upper}"
    raise ValueError(f"batch_size {batch_size} does not split over {gpus} GPUs (tightfit "
                     f"train's --batch-size is the global batch, rank r trains on its "
                     f"batch/{gpus} rows); pass --batch-size {near}, or --gpus that divides "
                     f"{batch_size}.")


def ddp_only(shape: ModelShape, setup: TrainSetup) -> str | None:
    """Why this configuration can only run as DDP (``None``: FSDP2 can shard it):
    ``tightfit train --fsdp`` refuses it, as :mod:`tightfit.distributed` does before any
    weight is read."""
    if shape.is_moe:
        return ("--fsdp cannot load MoE experts shard by shard (transformers fuses the "
                "checkpoint's per-expert weights as it loads; 4-bit experts keep their "
                "constants as buffers): DDP, every rank holds the whole model")
    if setup.quant == "int8":
        return ("--fsdp cannot shard an LLM.int8 base (Int8Params keep their scales outside "
                "the tensor): DDP, every rank holds the whole model")
    return None


def needs_host_shards(shape: ModelShape, setup: TrainSetup, usable: int, overhead: Overhead,
                      gpus: int) -> bool:
    """Whether one rank of ``gpus`` needs its shards on the host (``setup.fsdp_offload``,
    ``--fsdp-offload``) for ``setup`` to fit ``usable`` bytes: FSDP2 shards it, and the
    shards on the device leave too little room."""
    if gpus == 1 or ddp_only(shape, setup) is not None:
        return False
    return step_estimate(shape, setup, overhead, gpus).total > usable


@dataclass(frozen=True)
class RankEstimate(Estimate):
    """One rank's :class:`~tightfit.planner.estimate.Estimate` of a step on ``ranks`` GPUs.

    The pieces are the rank's: ``weights`` ... ``optimizer`` its shards (DDP: the whole
    model), ``gathered`` the unsharded parameters in flight, ``comm`` the collectives'
    buffers, ``activations`` / ``logits_loss`` those of its ``batch / ranks`` rows.
    ``total`` is the larger of the backward peak (the pieces' sum) and ``start_peak`` (the
    embedding gathered at the start of forward). ``ddp`` says why it is not sharded.
    """

    ranks: int = 1
    gathered: int = 0
    comm: int = 0
    start_peak: int = 0
    block_bytes: int = 0
    root_bytes: int = 0
    ddp: str | None = None

    PIECES = ("weights", "constants", "lora", "grads", "optimizer", "gathered", "comm",
              "activations", "logits_loss", "overhead")

    @property
    def total(self) -> int:
        return max(sum(getattr(self, p) for p in self.PIECES), self.start_peak)

    @property
    def sharded(self) -> bool:
        return self.ddp is None


@dataclass(frozen=True)
class BlockBytes:
    """Unsharded bytes of the units FSDP2 gathers (:func:`unit_bytes`)."""

    weights: int  # a decoder block's base weights (codes; norms, biases, router)
    constants: int  # its sharded constants (absmax, nested absmax)
    replicated: int  # its code books (buffers, never sharded)
    lora: int  # its LoRA params (lora_dtype)
    head: int  # the root's LM head + final norm (+ the embeddings when tied)
    embed: int  # the untied input embedding, a unit of its own (0 when tied)
    rotary: int  # rotary buffers (replicated)

    @property
    def block(self) -> int:
        """What one block's all-gather brings in."""
        return self.weights + self.constants + self.lora


def unit_bytes(shape: ModelShape, setup: TrainSetup) -> BlockBytes:
    """A decoder block's, the root's and the embedding's unsharded bytes, from the memory
    model's own totals (:func:`~tightfit.planner.estimate.base_weight_bytes`)."""
    weights, constants = base_weight_bytes(shape, setup)
    table = shape.vocab * shape.hidden * setup.d
    rotary = rotary_buffer_bytes(shape)
    embed = 0 if shape.tie_embeddings else table
    head = table + shape.hidden * setup.d  # + the final norm
    per_layer = (weights - rotary - head - embed) // shape.layers
    replicated = 0
    if setup.quant == "nf4":
        replicated = len(shape.weight_shapes()) * replicated_constant_bytes(setup.double_quant)
    n_lora, _ = lora_param_count(shape, setup)
    return BlockBytes(per_layer, constants // shape.layers - replicated, replicated,
                      n_lora // shape.layers * setup.lora_bytes, head, embed, rotary)


def _shard(nbytes: int, ranks: int) -> int:
    return -(-nbytes // ranks)


def rank_estimate(shape: ModelShape, setup: TrainSetup, overhead: Overhead | None,
                  ranks: int) -> RankEstimate:
    """One rank's bytes of a step of ``setup`` on ``ranks`` GPUs.

    Args:
        shape: The architecture.
        setup: The rank's setup: ``batch_size`` is the rank's rows (global batch / ranks),
            ``host_budget`` the rank's share of the host, ``optimizer_device_budget`` the
            rank's (tightfit train's ``--device-budget`` is per rank).
        overhead: Non-tensor device memory of the rank (``Overhead()`` by default).
        ranks: GPUs (``torchrun --nproc_per_node``).

    Returns:
        A :class:`RankEstimate`.
    """
    overhead = overhead or Overhead()
    one = estimate(shape, setup, overhead)  # the rank's rows, its model whole
    base = {f.name: getattr(one, f.name) for f in fields(Estimate)}
    why = ddp_only(shape, setup)
    if why is not None:  # DDP: the whole model, the grads again in the buckets
        tensors = one.total - one.overhead + one.grads
        base["overhead"] = overhead.bytes_for(tensors)
        return RankEstimate(**base, ranks=ranks, comm=one.grads, ddp=why)
    u = unit_bytes(shape, setup)
    layers = shape.layers
    weights = (layers * _shard(u.weights, ranks) + _shard(u.head, ranks)
               + _shard(u.embed, ranks) + u.rotary)
    constants = layers * (_shard(u.constants, ranks) + u.replicated)
    lora = layers * _shard(u.lora, ranks)
    state = _shard(optimizer_state_bytes(shape, setup), ranks)
    resident = state
    if setup.paged and setup.optimizer_device_budget is not None:
        resident = min(state, setup.optimizer_device_budget)
    gathered = u.head + GATHERED_BLOCKS * u.block
    comm = u.lora  # the reduce-scatter input of the block just done
    host_weights = 0
    if setup.fsdp_offload:
        # CPUOffloadPolicy: the shards, their grads and the optimizer (its step runs on the
        # host params) wait on the host; a unit's shard is copied to the device as its
        # all-gather input; the buffers (code books, rotary tables) stay on the device
        host_weights = weights - u.rotary + constants - layers * u.replicated + 2 * lora
        weights, constants, lora = u.rotary, layers * u.replicated, 0
        resident, comm = 0, comm + _shard(u.block, ranks)
    grads = lora + u.lora  # its shards + the block in backward's unsharded grads
    shards = weights + constants + lora + lora + resident  # params, grads, state
    tensors = (weights + constants + lora + grads + resident + gathered + comm
               + one.activation_peak)
    # the start: the root gathered, then the embedding with its all-gather output
    start = shards + u.head + max(u.head, 2 * u.embed)
    base.update(weights=weights, constants=constants, lora=lora, grads=grads,
                optimizer=resident, optimizer_offloaded=state - resident,
                host_weights=host_weights, overhead=overhead.bytes_for(tensors))
    return RankEstimate(**base, ranks=ranks, gathered=gathered, comm=comm,
                        start_peak=start + overhead.bytes_for(start), block_bytes=u.block,
                        root_bytes=u.head)
