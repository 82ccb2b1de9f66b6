"""Local shards of FSDP2 (DTensor) parameters, for optimizers that keep their own state.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every parameter is a ``DTensor``: a
global tensor of which this rank holds one shard. An optimizer that pages its state must size,
page and update the *local* shard only (``p.to_local()`` / ``p.grad.to_local()``), so budgets and
bytes moved are per rank. Its ``state_dict()`` must hand the state back as DTensors with the
param's mesh and placements: that is what lets ``torch.distributed.checkpoint`` reshard a
checkpoint onto another number of ranks. These helpers are that glue; on plain tensors (single
process or DDP, where each replica owns full-size state) they are the identity.
"""

from __future__ import annotations

import torch

try:  # torch >= 2.4; the import only fails on builds without torch.distributed
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # pragma: no cover - exercised only on such builds
    DTensor = None  # type: ignore[assignment,misc]
    Partial = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    """True when ``t`` is a ``DTensor`` (an FSDP2/tensor-parallel parameter or gradient)."""
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t``: ``t.to_local()`` for a DTensor, ``t`` itself otherwise.

    For an FSDP2 parameter the local tensor is a view of the sharded storage, so an in-place
    update of it updates the parameter.
    """
    return t.to_local() if is_dtensor(t) else t


def local_flat(t: torch.Tensor, start: int, end: int, *, in_place: bool) -> torch.Tensor:
    """Elements ``start:end`` of ``t``'s local shard, flat; the whole tensor without a slice
    when the range covers it (a LoRA step has hundreds of params, and each view costs
    microseconds of Python). ``in_place``: the result must be a view (a param the kernel
    updates; ``view`` raises rather than copy a non-contiguous one), else a copy may do."""
    if type(t) not in _PLAIN:
        t = local_tensor(t)
    flat = t.view(-1) if in_place else t.reshape(-1)
    return flat if start == 0 and end == flat.numel() else flat[start:end]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # never DTensors: skip the isinstance check


def local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` that this rank stores (and so pages state for)."""
    return local_tensor(p).numel()


def check_param(p: torch.Tensor) -> None:
    """Reject parameters whose local tensor is not this rank's share of the update.

    A ``Partial`` placement means the local tensor is a summand, not a shard: an elementwise
    optimizer would update the wrong values.

    Raises:
        TypeError: if ``p`` is a DTensor with a ``Partial`` placement.
    """
    if is_dtensor(p) and any(isinstance(pl, Partial) for pl in p.placements):
        raise TypeError(
            f"parameter with placements {p.placements} holds partial sums, not a shard; "
            "redistribute it to Shard/Replicate placements (as FSDP2 and DDP do) before "
            "building the optimizer"
        )


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap a state tensor laid out like ``param``'s local shard as ``param`` is wrapped.

    Args:
        local: state for this rank's shard, shaped like ``local_tensor(param)``.
        param: the parameter the state belongs to.

    Returns:
        A DTensor with ``param``'s mesh, placements, global shape and stride when ``param`` is a
        DTensor (no communication: the layout is copied, not checked; ``local`` stays on its
        device, e.g. host RAM for a CUDA mesh); ``local`` itself otherwise.
    """
    if not is_dtensor(param):
        return local
    if local.device.type == param.device_mesh.device_type:
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    # A state dict gathered to host RAM must stay there: from_local would copy it to the mesh's
    # device (all of a rank's optimizer state on the GPU at once). Build the DTensor on the
    # host-side local tensor as FSDP2's CPU offload does; DCP saves and loads such DTensors.
    spec = DTensorSpec(
        param.device_mesh,
        tuple(param.placements),
        tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype),
    )
    return DTensor(local, spec, requires_grad=False)


def local_state(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The local shard of a loaded state tensor, checked against ``param``'s local shard.

    ``load_state_dict`` receives DTensors from ``set_optimizer_state_dict`` (already resharded
    by DCP to this rank's layout) or plain tensors from a torch-format state dict.

    Raises:
        ValueError: if a DTensor state's placements differ from the param's, or the local
            shapes differ (a state dict from another model or another sharding).
    """
    if is_dtensor(value):
        if is_dtensor(param) and tuple(value.placements) != tuple(param.placements):
            raise ValueError(
                f"state placements {value.placements} differ from the parameter's "
                f"{param.placements}; load it through "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which "
                "reshards state to the parameter's layout"
            )
        value = value.to_local()
    want = local_tensor(param).shape
    if value.shape != want:
        raise ValueError(
            f"state of shape {tuple(value.shape)} does not match this rank's parameter shard "
            f"{tuple(want)}; load a state dict saved for this model, resharded with "
            "set_optimizer_state_dict when the number of ranks changed"
        )
    return value
