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

Every saved state holds ``checksums.json``, the XXH3-64 of each of its files but
``optimizer.pt`` (whose pages carry their own), and a resume verifies them all and reads every
file before it changes anything: a damaged file is a one-line error naming it, never a run
that trains on. Temps (``.LATEST.tmp-*``, ``.tmp-*`` saved-state folders, ...) carry their
process in their name (:mod:`tightfit.integrity.temps`); a run that starts in the folder removes
those of processes that no longer exist and says so.
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

from tightfit.integrity.checksums import ALGORITHM, CorruptStateError, file_checksum
from tightfit.integrity.owners import Removed
from tightfit.integrity.temps import remove_stale_temps, temp_path
from tightfit.measure.sizes import format_bytes
from tightfit.train.run_options import LAUNCH_KEYS, RESUME_FREE, RunConfig, flag_name

LATEST = "LATEST"
CONFIG = "run_config.json"
STATES_DIR = "checkpoints"  # the on-disk name predates the vocabulary; kept for old runs
CHECKSUMS = "checksums.json"
OPTIMIZER = "optimizer.pt"
TRAINER = "trainer_state.pt"
# temps of the run folder / of its checkpoints folder, each followed by its owner's token
_OUT_TEMPS = (f".{LATEST}.tmp-", f".{CONFIG}.tmp-", ".adapter.tmp-", ".adapter.old-")
_STATE_TEMPS = (".tmp-",)


@dataclass
class SavedState:
    """What a resume reads back: the step reached, the history so far, the folder read."""

    step: int
    history: list[dict[str, Any]]
    folder: Path


def _atomic_text(path: Path, text: str) -> None:
    tmp = temp_path(path.parent, f".{path.name}.tmp-")  # named first: always removable below
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    name = state_name(step)
    final = states / name
    tmp = Path(temp_path(states, ".tmp-") + f"-{name}")
    try:
        tmp.mkdir()
        # the trainable params only: a full state dict would also copy the frozen 4-bit base
        # to host RAM (and read every paged layer's home) for keys peft then drops
        model.save_pretrained(tmp / "adapter", state_dict=trainable_state(model))
        save_optimizer(optimizer, tmp / OPTIMIZER)
        torch.save({"step": step, "rng": rng_state(), "history": history}, tmp / TRAINER)
        write_checksums(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_state(out, tmp, final, keep)
    return final


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable params by their state-dict names: what peft's adapter file keeps."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def write_checksums(folder: Path) -> None:
    """Record the checksum of every file of the saved state ``folder`` but the optimizer's
    (its pages carry their own) in ``folder/checksums.json``."""
    sums = {str(p.relative_to(folder)): f"{file_checksum(p):016x}"
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in (OPTIMIZER, CHECKSUMS)}
    with open(folder / CHECKSUMS, "x") as f:
        json.dump({"algorithm": ALGORITHM, "files": sums}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


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
    try:
        folder = out / pointer.read_text().strip()
    except (OSError, UnicodeDecodeError, ValueError):
        raise _unusable(pointer, "LATEST cannot be read") from None
    return folder if (folder / TRAINER).is_file() else None


def _unusable(folder: Path, what: str) -> ValueError:
    return ValueError(f"cannot resume from the saved state {str(folder)!r}: {what}. Nothing was "
                      "changed; restore the run folder from a copy, or start a new --out.")


def verify_checksums(folder: Path) -> bool:
    """Check every file ``checksums.json`` lists (``False``: a saved state from before it).

    Raises:
        ValueError: a listed file is missing or its bytes differ.
    """
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return False
    try:
        files = json.loads(listing.read_text())["files"]
        items = [(str(k), int(v, 16)) for k, v in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise _unusable(folder, f"{CHECKSUMS} is damaged") from None
    for name, want in items:
        path = folder / name
        if not path.is_file():
            raise _unusable(folder, f"{name} is missing")
        if file_checksum(path) != want:
            raise _unusable(folder, f"{name} does not match its checksum ({ALGORITHM}): the "
                                    "file was damaged after it was saved")
    return True


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The saved state's ``trainer_state.pt`` (step, RNG states, history), every file of the
    saved state verified first (:func:`verify_checksums`) and the contents checked.

    Raises:
        ValueError: a damaged file or contents that are not a trainer state.
    """
    verify_checksums(folder)
    try:
        state = torch.load(folder / TRAINER, weights_only=True, map_location="cpu")
    except Exception as exc:  # a damaged zip or pickle raises many kinds
        raise _unusable(folder, f"{TRAINER} cannot be read ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    step = state.get("step") if isinstance(state, dict) else None
    ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
    ok = ok and isinstance(state.get("history"), list) and isinstance(state.get("rng"), dict)
    if not ok or not isinstance(state["rng"].get("cpu"), torch.Tensor):
        raise _unusable(folder, f"{TRAINER} holds no step, RNG states and history")
    return state


def load_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> SavedState:
    """Load adapter weights, optimizer state and RNG states from a saved state's folder.

    Every file is verified and read before anything changes, and the optimizer refuses a bad
    file whole: a damaged saved state is a ``ValueError`` naming the file, with the model and
    optimizer as they were (but for adapter keys this model lacks, found only when applied).
    """
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    state = read_trainer_state(folder)
    device = next(model.parameters()).device
    try:
        weights = load_peft_weights(str(folder / "adapter"), device=str(device))
    except Exception as exc:  # safetensors' and torch's errors for bad bytes
        raise _unusable(folder, f"the adapter cannot be read ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        load_optimizer(optimizer, folder / OPTIMIZER)
    except (ValueError, CorruptStateError, OSError, EOFError) as exc:
        # the optimizer's own advice (save it again, load another) is not the CLI's: say only
        # what is wrong, and _unusable says what to do
        what = exc.what if isinstance(exc, CorruptStateError) else str(exc)
        raise _unusable(folder, f"{OPTIMIZER} is refused: {what}") from None
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(
            f"saved state {str(folder)!r} has adapter weights this model does not have "
            f"({unexpected[:3]}...); resume with the configuration that wrote it."
        )
    set_rng_state(state["rng"])
    return SavedState(state["step"], list(state["history"]), folder)


def state_name(step: int) -> str:
    """The folder name of step ``step``'s saved state (``step-00000050``)."""
    return f"step-{step:08d}"


def state_step(folder: Path) -> int:
    """The step of a saved state from its folder's name (:func:`state_name`); nothing is read
    or verified (:func:`saved_step` does both)."""
    return int(folder.name.removeprefix("step-"))


def saved_step(folder: Path) -> int:
    """The step a saved state reached (its files verified: :func:`read_trainer_state`)."""
    return int(read_trainer_state(folder)["step"])


def clean_leftovers(out: Path, optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """Remove the temps of processes that no longer exist from the run folder ``out`` (and
    its saved states' folder); one line saying what was removed, with the spill folders the
    optimizer removed when it started (``None`` when there was nothing)."""
    removed: list[Removed] = remove_stale_temps(out, _OUT_TEMPS)
    removed += remove_stale_temps(out / STATES_DIR, _STATE_TEMPS)
    events = getattr(optimizer, "paging_events", None)
    spill = [e for e in events() if e.kind == "cleanup"] if callable(events) else []
    if not removed and not spill:
        return None
    parts = [Path(r.path).name for r in removed] + [f"{len(spill)} spill folder(s)"] * bool(spill)
    pids = sorted({r.pid for r in removed})
    total = sum(r.nbytes for r in removed) + sum(e.nbytes for e in spill)
    return (f"cleaned up after processes that no longer run{f' (pid {pids})' if pids else ''}: "
            f"removed {', '.join(parts)} ({format_bytes(total)})")


def write_config(out: Path, config: dict[str, Any]) -> None:
    _atomic_text(out / CONFIG, json.dumps(config, indent=2, sort_keys=True, default=str))


def read_config(out: Path, fix: str = "pass the --out folder of an earlier run to --resume"
                ) -> dict[str, Any]:
    """The options a run folder was written with (``run_config.json``).

    ``fix`` ends the message when ``out`` is no run folder (what the command takes instead).

    Raises:
        FileNotFoundError: ``out`` is no run folder.
        ValueError: its ``run_config.json`` is damaged (not a JSON object).
    """
    path = out / CONFIG
    if not path.is_file():
        what = "does not exist" if not out.exists() else f"has no {CONFIG}"
        raise FileNotFoundError(
            f"{str(out)!r} {what}: it is not a tightfit train output folder; {fix}."
        )
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError too
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc}); restore it from a copy of "
                         "the run folder, or start a new --out.") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{str(path)!r} holds no JSON object; restore it from a copy of the "
                         "run folder, or start a new --out.")
    return saved


def resumed_config(folder: str | os.PathLike[str], changes: dict[str, Any]) -> RunConfig:
    """The configuration saved in a run folder, with the few ``changes`` a resume may make.

    Args:
        folder: The run's output folder.
        changes: ``{"group.option": value}`` given again (``{"train.steps": 80}``); options in
            :data:`~tightfit.train.run_options.RESUME_FREE` may differ from the saved ones, any
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
    if latest_state(Path(folder)) is None:  # before comparing options: none would matter
        raise ValueError(f"--resume {folder}: nothing saved yet (the run stopped before its "
                         "first save, --save-every); start it again with --out, or delete the "
                         "folder first.")
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
    tmp = Path(temp_path(out, ".adapter.tmp-"))
    try:
        shutil.copytree(saved / "adapter", tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = Path(temp_path(out, ".adapter.old-"))
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
