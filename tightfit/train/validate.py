"""Checks of a run's options that need the machine or the file system, made first.

The option dataclasses check what a value alone can say (``--steps 0``); these check the rest
before anything is loaded or written: the learning rate (``inf`` or ``nan`` would train on and
fail at a later step, leaving a run folder behind), the device, the output folder, and a model
folder's ``config.json`` and weights (which transformers would report as a traceback). Each
raises ``ValueError`` or ``FileNotFoundError`` naming the flag, the value and the fix, which
``tightfit train`` prints as one line with exit code 2.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from tightfit.train.data.sources import find_source
from tightfit.train.data.tokenizer import check_tokenizer
from tightfit.train.run_options import RunConfig

_DEVICES = ("cpu", "cuda")


def check_run(cfg: RunConfig) -> None:
    """Raise for options this machine cannot run; changes nothing.

    Raises:
        ValueError: a non-finite or non-positive learning rate, an unknown or absent device,
            an output folder that is a file or cannot be made, a model folder whose
            ``config.json`` is not JSON, an empty ``--data`` file or folder.
        FileNotFoundError: a model folder that is missing or has no ``config.json``, weights
            or tokenizer (without ``--tokenizer``); a ``--data`` / ``--eval-data`` path that
            does not exist.
    """
    check_numbers(cfg)
    check_device(cfg.train.device)
    check_output(cfg.train.resume, cfg.train.out)
    if cfg.train.model is not None:
        check_model_folder(Path(cfg.train.model))
    check_tokenizer(cfg.train.model, cfg.train.tokenizer)
    for flag, path in (("--data", cfg.data.path), ("--eval-data", cfg.data.eval_data)):
        if path is not None:
            find_source(path, flag)  # exists, not empty, a folder's files of one kind


def check_numbers(cfg: RunConfig) -> None:
    """The learning rate is finite and > 0; the weight decay finite and >= 0."""
    lr, decay = cfg.optimizer.lr, cfg.optimizer.weight_decay
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr {lr} cannot train: the learning rate must be a finite number "
                         "> 0 (inf or nan turn the weights into nan at the first step); e.g. "
                         "--lr 2e-4.")
    if not (math.isfinite(decay) and decay >= 0):
        raise ValueError(f"--weight-decay {decay} must be a finite number >= 0; e.g. "
                         "--weight-decay 0.0.")


def check_device(device: str | None) -> None:
    """``device`` is ``None``, ``cpu`` or a CUDA device this machine has."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        d = None
    if d is None or d.type not in _DEVICES:
        raise ValueError(f"--device {device!r} is not a device tightfit train runs on; pass "
                         "cpu, cuda or cuda:N.")
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device} but this machine has no usable CUDA device "
                             "(torch.cuda.is_available() is False); pass --device cpu, or "
                             "check the driver and CUDA_VISIBLE_DEVICES.")
        if d.index is not None and d.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}; pass one of them.")


def check_output(resume: str | None, out: str | None) -> None:
    """The run folder is a folder, or can be made (its first existing parent is a writable
    folder)."""
    folder, flag = (resume, "--resume") if resume is not None else (out, "--out")
    if folder is None:
        return
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {folder!r} is a file, not a folder; pass a folder (a new "
                         "one, or with --resume the --out folder of an earlier run).")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {folder!r} cannot be made: {str(parent)!r} is a file; pass "
                         "a folder path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {folder!r} cannot be written ({str(parent)!r} is not "
                         "writable); pass a folder you can write to.")


def check_model_folder(folder: Path) -> None:
    """``folder`` exists and holds a readable ``config.json`` and weights (whole, or every
    shard an index names)."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {str(folder)!r} does not exist; pass a local Hugging Face model "
            "folder or omit --model for the built-in model.")
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json, so it is not a Hugging "
                                "Face model folder; save one with model.save_pretrained(folder).")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(config)!r} is not valid JSON ({exc}); restore the model "
                         "folder's config.json (model.save_pretrained writes it).") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{str(config)!r} holds no JSON object; restore the model folder's "
                         "config.json.")
    for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (folder / name).is_file():
            return
    for name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if (folder / name).is_file():
            _check_shards(folder / name)
            return
    raise FileNotFoundError(
        f"model folder {str(folder)!r} has no weights ({SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME}, or "
        "a sharded checkpoint's index); pass a folder written by model.save_pretrained.")


def _check_shards(index: Path) -> None:
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{str(index)!r} is not a weights index ({exc!r}); restore the model "
                         "folder.") from None
    missing = sorted(s for s in shards if not (index.parent / str(s)).is_file())
    if missing:
        raise FileNotFoundError(f"{str(index)!r} names weight shards the folder lacks "
                                f"({', '.join(missing[:3])}); copy the whole model folder.")
