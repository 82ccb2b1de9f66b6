"""Atomic resume state and bit-exact resume.

("Checkpoint" in tightfit means activation recompute, :mod:`tightfit.checkpoint`; what a run
saves to continue later is its *resume state*. The folder keeps its historical name
``checkpoints/`` so that existing run folders still resume.)

Layout of an output folder::

    out/
      run_config.json          what the run was: every option and the data's fingerprints
                               (``--resume DIR`` continues with them; see resumed_config)
      LATEST                   "checkpoints/step-00000050": the last complete saved state
      checkpoints/step-00000050/
        adapter/               the LoRA adapter, peft format (adapter_config.json + safetensors)
        optimizer.pt           the optimizer state (the paged optimizer's own streamed save)
        trainer_state.pt       step, RNG states, loss/memory history

A saved state is written into a temporary folder, renamed into place (a rename is atomic),
and only then does ``LATEST`` move to it (write a temp file + ``os.replace``); older saved
states are deleted last. A kill at any moment leaves ``LATEST`` naming a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit.train.options import LAUNCH_KEYS, RESUME_FREE, RunConfig, flag_name

LATEST = "LATEST"
CONFIG = "run_config.json"
STATES_DIR = "checkpoints"  # the on-disk name predates the vocabulary; kept for old runs


@dataclass
class SavedState:
    """What a resume reads back: the step reached, the history so far, the folder read."""

    step: int
    history: list[dict[str, Any]]
    folder: Path


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The paged optimizer's streamed ``save`` when it has one, else ``torch.save``."""
    if callable(getattr(optimizer, "save", None)):
        optimizer.save(path)
    else:
        torch.save(optimizer.state_dict(), path)


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Inverse of :func:`save_optimizer`."""
    if callable(getattr(optimizer, "load", None)):
        optimizer.load(path)
    else:
        optimizer.load_state_dict(torch.load(path, weights_only=True))


def rng_state() -> dict[str, Any]:
    """Every RNG a training step draws from (dropout on CPU and CUDA)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(
    out: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    history: list[dict[str, Any]],
    keep: int = 1,
) -> Path:
    """Write the resume state of ``step`` atomically and point ``LATEST`` at it.

    Returns:
        The saved state's folder.
    """
    states = out / STATES_DIR
    states.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final = states / name
    tmp = states / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter")
    save_optimizer(optimizer, tmp / "optimizer.pt")
    torch.save({"step": step, "rng": rng_state(), "history": history}, tmp / "trainer_state.pt")
    publish_state(out, tmp, final, keep)
    return final


def publish_state(out: Path, tmp: Path, final: Path, keep: int = 1) -> None:
    """Rename the complete saved state ``tmp`` to ``final`` and point ``LATEST`` at it.

    Then drops all but the newest ``keep`` saved states and any temp folder a kill left behind.
    """
    if final.exists():  # a re-run of the same step: the old copy is not LATEST's any more
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_text(out / LATEST, f"{STATES_DIR}/{final.name}\n")
    # Only now is it safe to drop older saved states (and any temp folder a kill left behind).
    states = final.parent
    done = sorted(p for p in states.iterdir() if p.name.startswith("step-") and p != final)
    for old in done[: max(0, len(done) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in states.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def latest_state(out: Path) -> Path | None:
    """The folder ``LATEST`` names, or ``None`` when there is no complete saved state."""
    pointer = out / LATEST
    if not pointer.is_file():
        return None
    folder = out / pointer.read_text().strip()
    return folder if (folder / "trainer_state.pt").is_file() else None


def load_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> SavedState:
    """Load adapter weights, optimizer state and RNG states from a saved state's folder."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    device = next(model.parameters()).device
    weights = load_peft_weights(str(folder / "adapter"), device=str(device))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(
            f"saved state {str(folder)!r} has adapter weights this model does not have "
            f"({unexpected[:3]}...); resume with the configuration that wrote it."
        )
    load_optimizer(optimizer, folder / "optimizer.pt")
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return SavedState(int(state["step"]), list(state["history"]), folder)


def saved_step(folder: Path) -> int:
    """The step a saved state reached."""
    return int(torch.load(folder / "trainer_state.pt", weights_only=False)["step"])


def write_config(out: Path, config: dict[str, Any]) -> None:
    _atomic_text(out / CONFIG, json.dumps(config, indent=2, sort_keys=True, default=str))


def read_config(out: Path) -> dict[str, Any]:
    path = out / CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(out)!r} has no {CONFIG}: it is not a tightfit train output folder; pass "
            "the --out folder of an earlier run to --resume."
        )
    return json.loads(path.read_text())


def resumed_config(folder: str | os.PathLike[str], changes: dict[str, Any]) -> RunConfig:
    """The configuration saved in a run folder, with the few ``changes`` a resume may make.

    Args:
        folder: The run's output folder.
        changes: ``{"group.option": value}`` given again (``{"train.steps": 80}``); options in
            :data:`~tightfit.train.options.RESUME_FREE` may differ from the saved ones, any
            other must equal its saved value. Launch options (``--fsdp``, ``--zero3``) are
            not inherited: they say how this process was started.

    Raises:
        FileNotFoundError: ``folder`` is no run folder.
        ValueError: ``--out`` given, or an option that would change the math.
    """
    if changes.get("train.out") is not None:
        raise ValueError(f"--resume {folder} continues the run in its own folder; drop --out "
                         "(to branch a run, copy its folder and resume the copy).")
    saved = read_config(Path(folder))
    launch = dict.fromkeys(LAUNCH_KEYS, False)
    base = RunConfig().with_flat({**saved, **launch, "train.out": None,
                                  "train.resume": str(folder)})
    wanted = base.with_flat({k: v for k, v in changes.items()
                             if k not in ("train.out", "train.resume")})
    old, new = base.flat(), wanted.flat()
    differ = sorted(k for k in new if k not in RESUME_FREE and new[k] != old.get(k))
    if differ:
        shown = ", ".join(f"{flag_name(k)} {new[k]!r} (saved: {old.get(k)!r})" for k in differ)
        free = sorted(flag_name(k) for k in RESUME_FREE if k not in ("train.out", "train.resume"))
        raise ValueError(f"--resume {folder} continues the run with its saved options; these "
                         f"differ: {shown}. Only {', '.join(free)} may change; start a new "
                         "--out to change the others.")
    return wanted


def config_mismatch(saved: dict[str, Any], current: dict[str, Any], free: set[str]) -> list[str]:
    """Keys whose values differ between two run configs (``free`` keys may differ)."""
    keys = (set(saved) | set(current)) - free
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def publish_adapter(out: Path, saved: Path) -> Path:
    """Copy the adapter of the saved state ``saved`` to ``out/adapter``, swapped in atomically."""
    final = out / "adapter"
    tmp = out / f".adapter.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(saved / "adapter", tmp)
    old = out / f".adapter.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
