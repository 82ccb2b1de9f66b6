"""``tightfit export RUN_DIR``: the trained adapter, and with ``--merge`` a merged HF model folder.

The adapter is the run's peft adapter as it is (``PeftModel.from_pretrained`` loads it on the
base). ``--merge`` writes a plain Hugging Face model folder that
``AutoModelForCausalLM.from_pretrained`` loads, with no peft and no bitsandbytes:

1. the base is quantized exactly as the run quantized it (``tightfit.prepare`` with the run's
   options) and each 4-bit layer dequantized by bitsandbytes: the adapters were trained
   against these weights, not the original ones;
2. those weights go into a fresh copy of the base (its own layer types: GPT-2's ``Conv1D``
   transposed back), the adapter is loaded on it with peft and merged (``merge_and_unload``);
3. the result is saved in ``--dtype`` (default bfloat16, QLoRA's compute dtype) with the
   run's tokenizer (the model folder's, or ``--tokenizer DIR``'s). Its loss equals the
   adapter model's within that dtype's rounding.

Nothing is written unless every step succeeded: the export is built in a temporary folder
and renamed into place.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tightfit.measure.dtypes import DTYPE_NAMES, torch_dtype
from tightfit.qlora.prepare import load_causal_lm, prepare
from tightfit.qlora.quantize import linear4bit_layers
from tightfit.train import builtin, resume
from tightfit.train.data.tokenizer import has_hf_tokenizer, tokenizer_folder
from tightfit.train.quiet import library_bars, no_library_deprecations
from tightfit.train.run_options import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tightfit export``."""
    parser.add_argument("run", metavar="RUN_DIR", help="a tightfit train output folder")
    parser.add_argument("--out", default=None,
                        help="where to write (default: RUN_DIR/export); must not exist yet")
    parser.add_argument("--merge", action="store_true",
                        help="also write merged/: the base dequantized and the adapter merged "
                             "into it, a plain HF model folder")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                        help="dtype of the merged weights (default: bfloat16)")


def run(args: argparse.Namespace) -> int:
    """``tightfit export``: write the export and say what was written."""
    with library_bars(not getattr(args, "quiet", False)):  # -q: no "Loading weights" bars
        files = export(args.run, out=args.out, merge=args.merge, dtype=args.dtype)
    for key, path in files.items():
        print(f"  {key:8s} {path}")
    return 0


def export(run_dir: str | os.PathLike[str], *, out: str | os.PathLike[str] | None = None,
           merge: bool = False, dtype: str = "bfloat16") -> dict[str, Path]:
    """Export a run's adapter (``out/adapter``) and, with ``merge``, a merged model (``out/merged``).

    Returns:
        ``{"adapter": ..., "merged": ...}``, the folders written.

    Raises:
        FileNotFoundError: ``run_dir`` is no run folder, or has no adapter yet.
        ValueError: ``out`` exists already, or the base has 4-bit layers export cannot
            dequantize.
    """
    folder = Path(run_dir)
    saved = resume.read_config(folder, "pass tightfit export the --out folder of a "
                               "tightfit train run (it holds run_config.json)")
    cfg = RunConfig().with_flat(saved)
    adapter = _adapter_of(folder)
    final = Path(out) if out is not None else folder / "export"
    if final.exists():
        raise ValueError(f"export folder {str(final)!r} exists already; pass another --out or "
                         "remove it.")
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(adapter, tmp / "adapter")
        if merge:
            merged_model(cfg, adapter, torch_dtype(dtype)).save_pretrained(tmp / "merged")
            tokenizer = tokenizer_folder(cfg.train.model, cfg.train.tokenizer)
            if tokenizer is not None and has_hf_tokenizer(tokenizer):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
                tok.save_pretrained(tmp / "merged")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"adapter": final / "adapter", **({"merged": final / "merged"} if merge else {})}


def _adapter_of(folder: Path) -> Path:
    if (folder / "adapter" / "adapter_config.json").is_file():
        return folder / "adapter"
    latest = resume.latest_state(folder)
    if latest is None:
        raise FileNotFoundError(f"{str(folder)!r} has no adapter yet (no saved state); train "
                                "it first.")
    return latest / "adapter"


def _base(cfg: RunConfig) -> nn.Module:
    """A fresh copy of the run's base model (the built-in one from the run's seed)."""
    if cfg.train.model is None:
        torch.manual_seed(cfg.train.seed)
        return builtin.builtin_model()
    return load_causal_lm(cfg.train.model)


def merged_model(cfg: RunConfig, adapter: Path, dtype: torch.dtype) -> nn.Module:
    """The run's base with its trained weights' dequantized values and the adapter merged in.

    Raises:
        ValueError: the run quantized weights that are not linear layers (4-bit MoE experts).
    """
    from peft import PeftModel

    weights = _dequantized_weights(cfg)
    base = _base(cfg)
    modules = dict(base.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            layer = modules[name]
            # GPT-2's Conv1D stores [in, out]: the quantized Linear held its transpose
            target = w.t() if type(layer).__name__ == "Conv1D" else w
            layer.weight.copy_(target.to(layer.weight.dtype))
    with no_library_deprecations():  # transformers' FutureWarnings at peft's calls
        model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    model = model.to(dtype)
    model.config.use_cache = True  # training turned it off; generation wants it
    return model


def _dequantized_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Name → the weight the run trained against (the 4-bit one dequantized), on the CPU."""
    if cfg.prepare.quant is None:
        return {}
    import bitsandbytes.functional as bnbf

    opts = replace(cfg.prepare, checkpoint=None, loss_chunks=None, compute_dtype="float32")
    quantized = prepare(_base(cfg), options=opts, lora=False, device="cpu")
    layers = dict(linear4bit_layers(quantized))
    other = sorted(set(quantized.tightfit_info.quantized) - set(layers))
    if other:
        raise ValueError(f"export --merge dequantizes 4-bit linear layers only; this run also "
                         f"quantized {other[:3]}; load the adapter with peft instead.")
    return {name: bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
            for name, layer in layers.items()}
