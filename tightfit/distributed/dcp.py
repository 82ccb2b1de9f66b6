"""Save and resume model + optimizer through ``torch.distributed.checkpoint`` (DCP).

DCP writes each rank's shards in parallel and reshards on load, so a checkpoint written by N
ranks resumes on M (including one process without a process group). The state-dict helpers
(``get_state_dict``/``set_state_dict``) turn parameter ids into fully qualified names and
strip FSDP2/DDP wrappers, so the same checkpoint loads into a sharded, a replicated or a plain
model. Paged optimizers take part like torch's: their ``state_dict()`` hands out DTensor state
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
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write model (and optimizer) state as a DCP checkpoint; every rank must call it.

    Args:
        checkpoint_dir: directory for the checkpoint (created; existing files overwritten).
        model: the model as trained (FSDP2-sharded, DDP-wrapped or plain).
        optimizer: its optimizer, if its state should be saved.
        extra: small picklable values to keep with it (step counter, data position …).
    """
    dcp, sd = _dcp()
    if optimizer is None:
        state: dict[str, Any] = {_MODEL: sd.get_model_state_dict(model)}
    else:
        msd, osd = sd.get_state_dict(model, optimizer)
        state = {_MODEL: msd, _OPTIM: osd}
    state[_EXTRA] = dict(extra or {})
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=os.fspath(checkpoint_dir), no_dist=not _dist_ready())


def load(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a DCP checkpoint into ``model`` (and ``optimizer``), resharding as needed.

    The optimizer must be built on ``model``'s (wrapped) parameters and not have stepped; DCP's
    helper initializes its state with one zero-learning-rate step, then overwrites it.

    Returns:
        The ``extra`` values saved with the checkpoint.

    Raises:
        FileNotFoundError: if ``checkpoint_dir`` holds no DCP checkpoint.
    """
    path = os.fspath(checkpoint_dir)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} holds no torch.distributed.checkpoint checkpoint (no .metadata); "
            "pass the directory given to tightfit.distributed.dcp.save"
        )
    dcp, sd = _dcp()
    no_dist = not _dist_ready()
    extra = _read_extra(dcp, path, no_dist)
    if optimizer is None:
        msd = sd.get_model_state_dict(model)
        state: dict[str, Any] = {_MODEL: msd}
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
        sd.set_model_state_dict(model, state[_MODEL])
        return extra
    msd, osd = sd.get_state_dict(model, optimizer)
    state = {_MODEL: msd, _OPTIM: osd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    sd.set_state_dict(
        model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM]
    )
    return extra


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
