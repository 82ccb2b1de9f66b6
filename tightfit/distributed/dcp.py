"""Save and resume model + optimizer state through ``torch.distributed.checkpoint`` (DCP).

(torch's module name aside, what is written here is *resume state*; "checkpoint" in tightfit
means activation recompute, :mod:`tightfit.checkpoint`.)

DCP writes each rank's shards in parallel and reshards on load, so a state saved by N ranks
resumes on M (including one process without a process group). The state-dict helpers
(``get_state_dict``/``set_state_dict``) turn parameter ids into fully qualified names and
strip FSDP2/DDP wrappers, so the same saved state loads into a sharded, a replicated or a
plain model. Paged optimizers take part like torch's: their ``state_dict()`` hands out DTensor state
for DTensor params and their ``load_state_dict()`` writes it back into pages.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from torch import nn

_MODEL, _OPTIM, _EXTRA = "model", "optim", "extra"


def _dcp():
    # Imported lazily: torch.distributed.checkpoint pulls in a lot for a CLI's startup.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


def save(
    state_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    trainable_only: bool = False,
    process_group: Any = None,
) -> None:
    """Write model (and optimizer) state with DCP; every rank must call it.

    Args:
        state_dir: directory for the saved state (created; existing files overwritten).
        model: the model as trained (FSDP2-sharded, DDP-wrapped or plain).
        optimizer: its optimizer, if its state should be saved.
        extra: small picklable values to keep with it (step counter, data position …).
        trainable_only: keep only params that require grad (LoRA adapters, not the frozen
            4-bit base, which the run rebuilds from the base model).
        process_group: the group of DCP's own collectives (default: the default group);
            the state-dict helpers themselves communicate with no one.
    """
    dcp, sd = _dcp()
    state = _state(sd, model, optimizer, trainable_only)
    state[_EXTRA] = dict(extra or {})
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=os.fspath(state_dir), no_dist=not _dist_ready(),
                 process_group=process_group)


def load(
    state_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load state saved by :func:`save` into ``model`` (and ``optimizer``), resharding as needed.

    ``trainable_only`` must match the save: only params that require grad are read.

    The optimizer must be built on ``model``'s (wrapped) parameters and not have stepped; DCP's
    helper initializes its state with one zero-learning-rate step, then overwrites it.

    Returns:
        The ``extra`` values saved with the state.

    Raises:
        FileNotFoundError: if ``state_dir`` holds no state DCP saved.
    """
    path = os.fspath(state_dir)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} holds no state saved by torch.distributed.checkpoint (no .metadata); "
            "pass the directory given to tightfit.distributed.dcp.save"
        )
    dcp, sd = _dcp()
    no_dist = not _dist_ready()
    extra = _read_extra(dcp, path, no_dist)
    # strict=False: a trainable-only saved state leaves the frozen params as they are
    options = sd.StateDictOptions(strict=not trainable_only)
    state = _state(sd, model, optimizer, trainable_only)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    if optimizer is None:
        sd.set_model_state_dict(model, state[_MODEL], options=options)
    else:
        sd.set_state_dict(
            model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM],
            options=options,
        )  # fmt: skip
    return extra


def load_full(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Load unsharded trainable state (one process's) into a sharded ``model`` and its
    ``optimizer``: every rank passes the whole of it, and keeps its shards (torch's
    state-dict helpers with ``full_state_dict=True``).

    Args:
        model: The model as trained (FSDP2-sharded, DDP-wrapped or plain).
        optimizer: Its optimizer, built on the model's (sharded) params, not stepped.
        params: Full tensors of the trainable params by name (:func:`trainable_fqns`).
        optim_state: A torch-format optimizer state dict (``state`` keyed by the position of
            the param in ``optimizer.param_groups``, as ``Optimizer.state_dict()`` gives).

    Raises:
        ValueError: the names or the number of params do not match the optimizer's.
    """
    _, sd = _dcp()
    names = {id(p): n for n, p in model.named_parameters()}
    order = [trainable_fqn(names[id(p)]) for g in optimizer.param_groups for p in g["params"]]
    if set(order) != set(params) or len(order) != sum(len(g["params"]) for g in
                                                      optim_state["param_groups"]):  # fmt: skip
        raise ValueError(
            f"the saved state holds {len(params)} trainable params and this optimizer "
            f"{len(order)} (e.g. {sorted(set(order) ^ set(params))[:3]}); resume with the "
            "configuration that wrote it")
    groups, i = [], 0
    for group in optim_state["param_groups"]:
        n = len(group["params"])
        groups.append({**group, "params": order[i : i + n]})
        i += n
    index = [p for g in optim_state["param_groups"] for p in g["params"]]
    state = {order[k]: optim_state["state"][pid] for k, pid in enumerate(index)
             if pid in optim_state["state"]}  # fmt: skip
    options = sd.StateDictOptions(full_state_dict=True, strict=False)
    sd.set_state_dict(model, optimizer, model_state_dict=params,
                      optim_state_dict={"state": state, "param_groups": groups},
                      options=options)  # fmt: skip


def trainable_fqn(name: str) -> str:
    """A parameter's name as DCP's state dicts have it (no DDP or torch.compile prefixes)."""
    name = name.removeprefix("module.").removeprefix("_orig_mod.")  # DDP, torch.compile
    return name.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")


def _state(
    sd: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
) -> dict[str, Any]:
    """The model (and optimizer) state dicts DCP saves from and loads into."""
    if optimizer is None:
        state: dict[str, Any] = {_MODEL: sd.get_model_state_dict(model)}
    else:
        msd, osd = sd.get_state_dict(model, optimizer)
        state = {_MODEL: msd, _OPTIM: osd}
    if trainable_only:
        state[_MODEL] = _only(state[_MODEL], trainable_fqns(model))
    return state


def trainable_fqns(model: nn.Module) -> set[str]:
    """Names (as in DCP's state dicts: no DDP/compile wrapper prefixes) of trainable params."""
    names = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            names.add(trainable_fqn(name))
    return names


def _only(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    kept = {k: v for k, v in state.items() if k in names}
    if not kept:
        raise ValueError(
            "the model has no trainable parameters to save; pass trainable_only=False "
            "or set requires_grad on the params to train"
        )
    return kept


def _read_extra(dcp: Any, path: str, no_dist: bool) -> dict[str, Any]:
    # Non-tensor values are stored as pickled bytes; their keys come from the metadata, so
    # the caller need not know what was saved.
    meta = dcp.FileSystemReader(path).read_metadata()
    prefix = _EXTRA + "."
    keys = [k for k in meta.state_dict_metadata if k.startswith(prefix)]
    if not keys:
        return {}
    state: dict[str, Any] = {_EXTRA: {k[len(prefix) :]: None for k in keys}}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    return state[_EXTRA]


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns on every single-process call that it "assumes" single-process intent; here
    # that is the documented mode (resume on one process), so the warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
