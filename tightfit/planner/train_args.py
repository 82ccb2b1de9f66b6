"""The ``tightfit train`` options that select a planned configuration.

The flag names are those ``tightfit train`` generates from its option dataclasses
(:mod:`tightfit.qlora.prepare_options`, :mod:`tightfit.optim.registry`, :mod:`tightfit.train.loop`);
the values need no translation: a :class:`TrainSetup` holds the same dtype names
(:mod:`tightfit.measure.dtypes`) and optimizer kinds (the registry's).
"""

from __future__ import annotations

from tightfit.measure.sizes import parse_bytes
from tightfit.planner.train_setup import TrainSetup

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def size_arg(nbytes: int) -> str:
    """``nbytes`` as a size ``tightfit train`` reads back (its byte options go through
    :func:`~tightfit.measure.sizes.parse_bytes`) to at most ``nbytes``: a whole number of GiB
    or MiB when it is one (a paged budget of whole pages: ``"96MiB"``), else the largest unit
    it fills to two decimals, rounded down (``15924214945`` -> ``"14.83GiB"``, 0.6 MiB less; at most 1 % of the unit).
    """
    for unit, size in _UNITS[:2]:
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    for unit, size in _UNITS:
        if nbytes >= size:
            hundredths = nbytes * 100 // size
            while True:  # parse_bytes multiplies a float: step down until it reads <= nbytes
                whole, cents = divmod(hundredths, 100)
                text = f"{whole}.{cents:02d}".rstrip("0").rstrip(".") + unit
                if parse_bytes(text) <= nbytes:
                    return text
                hundredths -= 1
    return str(nbytes)


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
             "--lora-dtype", setup.lora_dtype, "--lora-compute", setup.lora_compute]
    if setup.lora_target_modules != "all-linear":
        args += ["--lora-target-modules", ",".join(setup.lora_target_modules)]
    args += ["--checkpoint", setup.checkpoint]
    if setup.checkpoint == "budget" and setup.checkpoint_budget:
        args += ["--checkpoint-budget", size_arg(setup.checkpoint_budget)]
    args += ["--loss-chunks",
             "none" if setup.loss_chunk_tokens is None else str(setup.loss_chunk_tokens)]
    # the planned row's activation placement, exactly: "auto" could tile or offload on its own
    args += ["--offload", setup.offload,
             "--mlp-tile", "none" if setup.mlp_tile is None else str(setup.mlp_tile)]
    if setup.resident_layers != "all":
        args += ["--resident-layers", str(setup.resident_layers)]
    if setup.fsdp_offload:
        args += ["--fsdp-offload"]
    args += ["--optimizer", setup.optimizer]
    if setup.paged and setup.optimizer_device_budget is not None:
        args += ["--device-budget", size_arg(setup.optimizer_device_budget)]
    return tuple(args)
