"""The ``tightfit train`` options that select a planned configuration.

The flag names are those ``tightfit train`` generates from its option dataclasses
(:mod:`tightfit.qlora.prepare_options`, :mod:`tightfit.optim.registry`, :mod:`tightfit.train.loop`);
the values need no translation: a :class:`TrainSetup` holds the same dtype names
(:mod:`tightfit.measure.dtypes`) and optimizer kinds (the registry's).
"""

from __future__ import annotations

from tightfit.planner.train_setup import TrainSetup


def train_args(setup: TrainSetup) -> tuple[str, ...]:
    """Command-line options of ``tightfit train`` for ``setup`` (model/data not included)."""
    args = [
        "--seq-len", str(setup.seq_len),
        "--batch-size", str(setup.batch_size),
        "--compute-dtype", setup.compute_dtype,
        "--quant", "nf4" if setup.quant == "nf4" else "none",
    ]
    if setup.quant == "nf4":
        args.append("--double-quant" if setup.double_quant else "--no-double-quant")
    args += ["--lora-r", str(setup.lora_r), "--lora-dropout", f"{setup.lora_dropout:g}",
             "--lora-dtype", setup.lora_dtype]
    if setup.lora_target_modules != "all-linear":
        args += ["--lora-target-modules", ",".join(setup.lora_target_modules)]
    args += ["--checkpoint", setup.checkpoint]
    if setup.checkpoint == "budget" and setup.checkpoint_budget:
        args += ["--checkpoint-budget", str(setup.checkpoint_budget)]
    args += ["--loss-chunks",
             "none" if setup.loss_chunk_tokens is None else str(setup.loss_chunk_tokens)]
    # the planned row's activation placement, exactly: "auto" could tile or offload on its own
    args += ["--offload", setup.offload,
             "--mlp-tile", "none" if setup.mlp_tile is None else str(setup.mlp_tile)]
    args += ["--optimizer", setup.optimizer]
    if setup.paged and setup.optimizer_device_budget is not None:
        args += ["--device-budget", str(setup.optimizer_device_budget)]
    return tuple(args)
