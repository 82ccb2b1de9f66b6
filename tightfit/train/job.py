"""``tightfit train`` under torchrun: wrap, split batches, save resume state with DCP, gather.

The training loop asks a :class:`TrainJob` for everything that differs between one process
and many; in a single process (no torchrun) every method is the identity or the loop's own
single-process behaviour, so the loop has one code path.

Under torchrun each rank trains on its rows of every global batch (``--batch-size`` is the
global batch), the model is DDP-wrapped or, with ``--fsdp``, FSDP2-sharded (the frozen 4-bit
base's codes and constants, the LoRA params, their grads and the paged optimizer state), and a
saved state's folder holds the trainable params + optimizer as DCP wrote them (``dcp/``, any
rank count can resume it), the adapter in peft format (gathered, written by rank 0), the
trainer state (rank 0) and each rank's RNG state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tightfit.distributed import dcp, launch
from tightfit.distributed.parallelize import shard_model, shards_on_host
from tightfit.distributed.sharded_load import load_sharded
from tightfit.distributed.stop import PeerStop
from tightfit.optim.dtensor import is_dtensor, local_numel, local_tensor
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.qlora.shardable import base_bytes
from tightfit.train import resume

DCP_DIR = "dcp"


@dataclass
class TrainJob:
    """Where this process sits and how the model is made data-parallel."""

    info: launch.DistInfo
    strategy: Literal["single", "ddp", "fsdp"]
    # FSDP2: free each block's gathered params after its forward (ZeRO-3) or keep them to
    # backward (ZeRO-2). Both work with checkpoint plans (the recompute runs FSDP2's hooks).
    # A block with a frozen base (QLoRA) is always ZeRO-3: its base is sharded, and ZeRO-2
    # would hold every block's gathered base at the end of forward (shard_model forces it).
    reshard_after_forward: bool = False
    # FSDP2: every shard (base, LoRA, grads) and the optimizer step on the host
    # (CPUOffloadPolicy, --fsdp-offload); the device holds what is gathered in flight
    fsdp_offload: bool = False
    # the model FSDP2 sharded (set by wrap / load_sharded): the report's per-rank base bytes
    sharded: nn.Module | None = field(default=None, repr=False)
    # under torchrun: how a rank that fails in its step stops the others and the last
    # completed step is saved once (tightfit.distributed.stop)
    stop: PeerStop | None = field(default=None, repr=False)

    @property
    def distributed(self) -> bool:
        return self.strategy != "single"

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    # ------------------------------------------------------------------ setup
    @classmethod
    def start(cls, fsdp: bool, batch_size: int, device: str | None = None, *,
              reshard_after_forward: bool = False, fsdp_offload: bool = False) -> TrainJob:
        """Initialize from torchrun's environment (or a single process without it).

        ``reshard_after_forward`` picks ZeRO-3 over ZeRO-2 under ``fsdp``, ``fsdp_offload`` keeps
        the shards on the host (see the fields).

        Raises:
            ValueError: ``fsdp`` without torchrun, a global batch the ranks cannot split, or
            a CUDA device index (``cuda:N``) under torchrun.
        """
        if not launch.launched_by_torchrun():
            if fsdp:
                raise ValueError(
                    "--fsdp shards the model across processes: launch with "
                    "`torchrun --nproc_per_node N -m tightfit.cli train --fsdp ...`, or drop --fsdp"
                )
            return cls(launch.DistInfo(), "single")
        world = int(os.environ["WORLD_SIZE"])
        if batch_size % world:
            raise ValueError(
                f"--batch-size {batch_size} is the global batch and must divide by the {world} "
                f"processes; pass a multiple of {world}"
            )
        # Under torchrun each rank takes cuda:LOCAL_RANK: only the device type is the user's.
        _refuse_device_index(device)
        kind = "auto" if device is None else torch.device(device).type
        info = launch.init_from_env(device=kind)  # type: ignore[arg-type]
        return cls(info, "fsdp" if fsdp else "ddp", reshard_after_forward, fsdp_offload and fsdp,
                   stop=PeerStop())

    def model_device(self, requested: str | None) -> str | torch.device | None:
        """Where the model and optimizer go: this rank's device under torchrun (the one NCCL
        was bound to), else what ``--device`` asked for (``None``: the default)."""
        return self.info.device if self.distributed else requested

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to run forward/backward through (``model`` itself in one process)."""
        if not self.distributed:
            return model
        if self.strategy == "ddp":
            return shard_model(model, "ddp")
        # The frozen base, grads and the paged optimizer state are sharded either way.
        self.sharded = shard_model(model, "fsdp", reshard_after_forward=self.reshard_after_forward,
                                   fsdp_offload=self.fsdp_offload)
        return self.sharded

    def loads_shards(self, model_folder: str | None) -> bool:
        """Whether each rank loads only its shards of the model (``--fsdp --model DIR``).

        The built-in model has no weights to read: under ``--fsdp`` every rank builds it
        from the seed and :meth:`wrap` shards it (it is tiny)."""
        return self.strategy == "fsdp" and model_folder is not None

    def load_sharded(
        self,
        folder: str,
        options: PrepareOptions,
        lora: LoraOptions | None,
        example: dict[str, torch.Tensor],
        check: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """The prepared model of ``folder``, FSDP2-sharded as it loads (no rank holds the
        whole model): :func:`tightfit.distributed.sharded_load.load_sharded`. ``check`` runs
        on the model while it is still on the meta device, before any weight is read."""
        self.sharded = load_sharded(folder, options, lora=lora, example=example,
                                    device=self.info.device, check=check,
                                    fsdp_offload=self.fsdp_offload)  # fmt: skip
        return self.sharded

    def rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's contiguous rows of a global batch."""
        if not self.distributed:
            return batch
        per = next(iter(batch.values())).shape[0] // self.info.world_size
        lo = self.info.rank * per
        return {k: v[lo : lo + per] for k, v in batch.items()}

    # ------------------------------------------------------------------ figures
    def mean(self, value: float) -> float:
        """Mean of ``value`` over ranks (the global loss when each rank has equal tokens)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(t)
        return float(t.item()) / self.info.world_size

    def total(self, values: list[float]) -> list[float]:
        """Each of ``values`` summed over ranks (``values`` itself in one process)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (``[obj]`` in one process)."""
        return launch.gather_objects(obj) if self.distributed else [obj]

    def rank_figures(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Per-rank values of a step record, gathered; ``{}`` in one process.

        Returns ``ranks`` (one dict per rank with this rank's ``device_bytes``, ``paged_in``,
        ``paged_out``, ``activation_peak``, ``seconds``) and, so that one-line plots show the
        worst rank against the per-rank budget, ``device_bytes`` = the largest rank's value.
        Every rank must call it.
        """
        if not self.distributed:
            return {}
        keys = ("device_bytes", "paged_in", "paged_out", "activation_peak", "seconds")
        ranks = self.gather({k: rec.get(k) for k in keys})
        return {"ranks": ranks, "device_bytes": max(r["device_bytes"] or 0 for r in ranks)}

    def report_meta(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Run layout and each rank's optimizer memory figures for the report; every rank calls."""
        if not self.distributed:
            return {}
        fn = getattr(optimizer, "memory_stats", None)
        stats = dict(fn()) if callable(fn) else {}
        keep = ("state_bytes", "device_bytes", "host_bytes", "disk_bytes", "peak_device_bytes",
                "bytes_paged_in", "bytes_paged_out", "device_budget",
                "target_bytes", "watch_reads", "evict_events", "restore_events")  # fmt: skip
        mine = {k: stats.get(k) for k in keep}
        mine["local_param_elements"] = sum(
            local_numel(p) for g in optimizer.param_groups for p in g["params"]
        )
        if self.sharded is not None:  # the 4-bit base: this rank's shards, the whole, a block
            mine["base_bytes"] = base_bytes(self.sharded)
            mine["shards_on_host"] = shards_on_host(self.sharded)
        return {"world_size": self.info.world_size, "strategy": self.strategy,
                "ranks": self.gather(mine)}  # fmt: skip

    def barrier(self, group: Any = None) -> None:
        if self.distributed:
            torch.distributed.barrier(group)

    # ------------------------------------------------------------------ a rank fails
    def updating(self) -> contextlib.AbstractContextManager[Any]:
        """Held around a step's update: a save after another rank's failure waits for it."""
        return self.stop.lock if self.stop is not None else contextlib.nullcontext()

    def on_peer_failure(self, save: Callable[[Any], None]) -> None:
        """What this rank runs when another rank failed in its step: ``save(group)``, the
        collective save of the last completed step over the group the dead step does not
        block (run by this rank's watcher thread, the update lock held)."""
        if self.stop is not None:
            group = self.stop.group
            self.stop.on_stop(lambda _line: save(group))

    def fail(self, line: str, save: Callable[[Any], None]) -> None:
        """This rank failed in its step (``line`` says how): tell the others, then run the
        same ``save(group)`` as they do, once, together."""
        if self.stop is None:
            return
        self.stop.fail(line)
        with self.stop.lock:
            save(self.stop.group)

    @property
    def peer_failed(self) -> str | None:
        """The failed rank's line once another rank failed and this one joined the save."""
        if self.stop is None or self.stop.peer_line is None:
            return None
        self.stop.saved.wait(timeout=self.stop.save_timeout_s)
        return self.stop.peer_line

    def close(self) -> None:
        if self.distributed:
            if self.stop is not None:
                self.stop.close()
            launch.close()

    def _comm_device(self) -> torch.device:
        return self.info.device if self.info.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------ resume state
    def save_state(
        self,
        out: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        history: list[dict[str, Any]],
        *,
        rng: dict[str, Any] | None = None,
        group: Any = None,
    ) -> Path:
        """Write the resume state of ``step`` (every rank calls it); atomic like one process's.

        ``rng``: the RNG states to keep (default: the current ones). ``group``: the process
        group of the save's collectives (default: the training one; after a rank failed,
        :attr:`tightfit.distributed.stop.PeerStop.group`, which the dead step does not block).

        Returns:
            The saved state's folder.
        """

        rng = resume.rng_state() if rng is None else rng
        if not self.distributed:
            return resume.save_state(out, step, model, optimizer, history)
        name = resume.state_name(step)
        states = out / resume.STATES_DIR
        tmp, final = states / f".tmp-{name}-dist", states / name
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier(group)
        dcp.save(tmp / DCP_DIR, model, optimizer, trainable_only=True, process_group=group)
        adapter = _full_state(model, group)  # collective; rank 0 gets the tensors
        torch.save(rng, tmp / f"rng-rank{self.info.rank}.pt")
        if self.is_main:
            model.save_pretrained(tmp / "adapter", state_dict=adapter)
            torch.save({"step": step, "rng": rng, "history": history,
                        "world_size": self.info.world_size, "strategy": self.strategy},
                       tmp / "trainer_state.pt")  # fmt: skip
        self.barrier(group)  # every rank's DCP shard and RNG file is written
        if self.is_main:  # checksums of every file, then publish: rename, LATEST, drop older
            resume.write_checksums(tmp)
            resume.publish_state(out, tmp, final)
        self.barrier(group)
        return final

    def load_state(
        self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> resume.SavedState:
        """Resume from the state saved in ``folder`` by one process or by any number of ranks.

        Returns:
            The step, the history and the folder read back.

        Raises:
            ValueError: a damaged saved state, or one of another configuration.
        """

        if not (folder / DCP_DIR).is_dir():
            if self.strategy == "fsdp":  # one process's state: each rank keeps its shards
                return _load_unsharded(folder, model, optimizer)
            return resume.load_state(folder, model, optimizer)  # DDP: every replica loads it
        # every file verified (checksums.json) and the trainer state read before DCP changes
        # anything: a damaged saved state is refused whole, as one process's is
        state = resume.read_trainer_state(folder)
        rng = folder / f"rng-rank{self.info.rank}.pt"
        # The same layout continues each rank's RNG stream; another rank count cannot.
        same_layout = state.get("world_size") == self.info.world_size and rng.is_file()
        rank_rng = torch.load(rng, weights_only=True, map_location="cpu") if same_layout else None
        dcp.load(folder / DCP_DIR, model, optimizer, trainable_only=True)
        if rank_rng is not None:
            resume.set_rng_state(rank_rng)
        return resume.SavedState(int(state["step"]), list(state["history"]), folder)


def _load_unsharded(folder: Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> resume.SavedState:
    """One process's saved state (peft adapter + page file) into the FSDP2-sharded ``model``.

    Every rank reads the whole trainable state (the adapter and its optimizer state: LoRA's
    size, not the model's): the page file is read into a twin of ``optimizer`` (its class
    and paging) over full-size host copies of the params, as one process laid it out, and
    each rank keeps its shards of both (:func:`tightfit.distributed.dcp.load_full`). The
    RNG streams are not continued (another layout draws other streams), as for DCP's
    N -> M.
    """
    from peft.utils import load_peft_weights

    state = resume.read_trainer_state(folder)  # every file verified before anything changes
    weights = load_peft_weights(str(folder / "adapter"), device="cpu")
    adapter = getattr(model, "active_adapter", "default")
    full = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = name.replace(f".{adapter}.", ".")
            if key not in weights:
                raise ValueError(f"saved state {str(folder)!r} has no adapter weight {key!r}; "
                                 "resume with the configuration that wrote it.")
            full[dcp.trainable_fqn(name)] = weights[key].to(p.dtype)
    twin_groups, by_id = [], {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        copies = [full[dcp.trainable_fqn(by_id[id(p)])].clone().requires_grad_(True)
                  for p in group["params"]]  # fmt: skip
        twin_groups.append({**{k: v for k, v in group.items() if k != "params"},
                            "params": copies})  # fmt: skip
    kwargs = getattr(optimizer, "_init_kwargs", dict)()
    twin = type(optimizer)(twin_groups, **kwargs)
    try:
        resume.load_optimizer(twin, folder / resume.OPTIMIZER)
        as_torch = getattr(twin, "torch_state_dict", None)  # 8-bit: its fp32 form
        optim_state = as_torch() if callable(as_torch) else twin.state_dict()
    finally:
        close = getattr(twin, "close", None)
        if callable(close):
            close()
    dcp.load_full(model, optimizer, full, optim_state)
    return resume.SavedState(int(state["step"]), list(state["history"]), folder)


def _full_state(model: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """Unsharded trainable params (peft's adapter keys) on rank 0; every rank must call it.

    Only what trains is gathered (one ``full_tensor()`` per sharded param, the same order on
    every rank): a full state dict would also copy the frozen 4-bit base to host RAM. With
    ``group`` (a save after a rank failed: the training group is blocked) each rank's dim-0
    shards go to rank 0 over it as objects and are joined there (FSDP2 cuts dim 0 in rank
    order).
    """
    out = {}
    main = torch.distributed.get_rank() == 0
    if group is not None:
        mine = {name: local_tensor(p).detach().to("cpu", copy=True)
                for name, p in model.named_parameters() if p.requires_grad}  # fmt: skip
        every: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.gather_object(mine, every if main else None, dst=0, group=group)
        if not main:
            return {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                parts = [part[name] for part in every]
                out[name] = torch.cat(parts) if is_dtensor(p) else parts[0]
        return out
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if is_dtensor(p) else p
        if main:
            out[name] = full.detach().to("cpu", copy=True)
    return out


def _refuse_device_index(device: str | None) -> None:
    """Under torchrun, ``--device cuda:N`` is refused rather than overridden.

    Each rank computes on ``cuda:LOCAL_RANK`` (NCCL's process group is bound to it), so an
    index would put every rank on one GPU. Overriding it silently would hide that the user's
    choice of GPU was not honoured; refusing it is the same on every rank (they all parse the
    same arguments), so no rank is left waiting in the process group for one that raised.
    """
    if device is None:
        return
    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        raise ValueError(
            f"--device {device} under torchrun: each rank computes on cuda:LOCAL_RANK (the GPU "
            "NCCL binds), so an index would put every rank on one GPU; pass --device cuda and "
            "choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
