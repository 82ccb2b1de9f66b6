"""``tightfit.prepare``: stack NF4 + double quant, LoRA, a checkpoint plan and chunked loss.

Order matters and is fixed here so that every caller gets the same stack:

1. load (a local HF causal-LM folder) or take the model; check every option against it
   *before* anything changes (LoRA targets that match nothing, an unknown policy, ...);
2. freeze the base and swap its linear layers for bitsandbytes ``Linear4bit`` (NF4 + DQ);
   MoE experts kept as fused 3-D weights get the same storage per expert
   (:mod:`tightfit.qlora.experts`);
3. wrap with peft LoRA adapters (all linear layers and expert weights except the output head
   by default; experts through peft's parameter targets, :mod:`tightfit.qlora.expert_lora`);
4. compute the LM head + loss in chunks (tightfit.loss) so full logits never exist;
5. install the checkpoint plan (tightfit's planner, profiling the chunked model).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tightfit.checkpoint.long_step import Adapters, check_inputs, plan_activations
from tightfit.checkpoint.plan import Plan, parse_policy
from tightfit.checkpoint.tiling import Tiling
from tightfit.loss import enable_chunked_loss
from tightfit.measure.dtypes import torch_dtype
from tightfit.model.blocks import find_blocks
from tightfit.pressure.room import machine_room
from tightfit.qlora.coverage import coverage_notes
from tightfit.qlora.experts import check_experts, expert_modules, expert_weight_names
from tightfit.qlora.paged_base import check_resident_layers, enable_paged_base
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.qlora.quantize import output_head_names, quantize_base


@dataclass
class PrepareInfo:
    """What :func:`prepare` did, kept on the model as ``model.tightfit_info``.

    Attributes:
        options: The options used.
        lora: The LoRA options used (``None``: no adapters).
        device: Where the model lives.
        compute_dtype: Dtype of the matmuls and of the unquantized weights.
        quantized: Qualified names of the layers (and MoE expert weights) now in 4 bits.
        adapted: Qualified names of the layers (and MoE expert weights) that got
            adapters.
        base_numel: Parameters of the base model before any change (what full fine-tuning
            would train).
        plan: The installed checkpoint plan (``None`` when checkpointing is off).
        loss_chunks: Tokens per loss chunk actually installed (``None``: unchunked).
        tiling: The tiled MLPs (:class:`tightfit.checkpoint.Tiling`; ``None``: untiled),
            chosen when a long step needed them (:mod:`tightfit.checkpoint.long_step`).
        notes: Anything the caller should know (a fallback taken, a piece skipped, the
            weights left in full precision or without adapters).
    """

    options: PrepareOptions
    lora: LoraOptions | None
    device: torch.device
    compute_dtype: torch.dtype
    quantized: list[str] = field(default_factory=list)
    adapted: list[str] = field(default_factory=list)
    base_numel: int = 0
    plan: Plan | None = None
    loss_chunks: int | str | None = None
    notes: list[str] = field(default_factory=list)
    tiling: Tiling | None = None


def load_causal_lm(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None) -> nn.Module:
    """Load a causal LM from a local Hugging Face folder, with errors that say what to fix.

    Args:
        path: A folder holding ``config.json`` and the weights (nothing is downloaded).
        dtype: Dtype to load the weights in (default: the checkpoint's).

    Raises:
        FileNotFoundError: The folder or its ``config.json`` is missing.
        ValueError: The folder holds a model that is not a causal language model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {str(folder)!r} does not exist; pass a local Hugging Face model "
            "folder (with config.json and weights) or omit --model for the built-in model."
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no config.json, so it is not a Hugging Face model folder; "
            "save one with model.save_pretrained(folder)."
        )
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{str(folder)!r} holds a {config.model_type!r} model, which is not a causal language "
            "model; pass a folder of a decoder model (Llama, Qwen2, GPT-2, ...)."
        )
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)


def _adapted_names(
    model: nn.Module, lora: LoraOptions, quant: str | None
) -> tuple[list[str], list[str]]:
    """The linear layers and the MoE expert weights the LoRA options select (checked before
    any change): ``(module names, parameter names)``."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers (peft adapts them)

    heads = output_head_names(model)
    linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, Conv1D)) and n not in heads and not n.endswith("lm_head")
    ]
    experts = [f"{q}.{w}" for q, m in expert_modules(model) for w in expert_weight_names(m)]
    if lora.target_modules == "all-linear":
        names, params = linears, experts
    else:
        wanted = tuple(lora.target_modules)
        names = [n for n in linears if n.split(".")[-1] in wanted or n in wanted]
        params = [n for n in experts if n.split(".")[-1] in wanted or n in wanted]
    if not names and not params:
        sample = sorted({n.split(".")[-1] for n in linears + experts})[:12]
        raise ValueError(
            f"LoRA target_modules {lora.target_modules!r} match no linear layer or expert weight "
            f"of the model; they are named {sample}; pass some of these or 'all-linear'."
        )
    if params and lora.dropout and quant is None:
        # 4-bit experts apply dropout per expert (expert_lora); peft's own wrapper cannot
        raise ValueError(
            f"LoRA dropout={lora.dropout} cannot apply to full-precision MoE expert weights "
            "(peft's ParamWrapper folds the adapter into the weight, so there is no adapter "
            "input to drop); pass dropout=0, a 4-bit base (quant='nf4'), or target_modules "
            f"without the expert weights ({sorted({p.split('.')[-1] for p in params})})."
        )
    return names, params


def _check_model(
    model: nn.Module, options: PrepareOptions, lora: LoraOptions | None
) -> tuple[list[str], list[str]]:
    """Refuse what cannot be done right before anything changes; the LoRA targets."""
    if options.quant is not None or lora is not None:
        check_experts(model)  # 3-D weights outside transformers' fused-experts contract
    return _adapted_names(model, lora, options.quant) if lora is not None else ([], [])


def _auto_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def prepare(
    model_or_path: nn.Module | str | os.PathLike[str],
    options: PrepareOptions | None = None,
    *,
    lora: LoraOptions | Mapping[str, Any] | Literal[False] | None = None,
    example: Mapping[str, Any] | torch.Tensor | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Stack the QLoRA memory pieces on a causal LM and return the model to train.

    >>> model = tightfit.prepare(model, checkpoint_budget=2 << 30, example=batch)
    >>> model = tightfit.prepare(model, PrepareOptions(quant="fp4"), lora={"r": 32})

    Args:
        model_or_path: An ``nn.Module`` (an HF causal LM) or a local HF model folder.
        options: How the pieces are stacked (:class:`PrepareOptions`; default: its
            defaults, the QLoRA recipe).
        lora: LoRA options (a dict or :class:`LoraOptions`); ``None`` defaults to
            ``LoraOptions()``; pass ``False`` for no adapters (then nothing is trainable
            unless ``quant`` is ``None``).
        example: A batch as the model is called with it (``{"input_ids": ..., "labels": ...}``);
            the planner profiles it. Without one, ``"budget"`` falls back to ``"sqrt"``.
        device: Where to put the model (default: CUDA when available, else the CPU).
        **overrides: Fields of :class:`PrepareOptions` by name (``quant``, ``double_quant``,
            ``blocksize``, ``compute_dtype``, ``checkpoint``, ``checkpoint_budget``,
            ``loss_chunks``, ``offload``, ``offload_host_budget``, ``offload_dir``,
            ``mlp_tile``, ``resident_layers``), each documented there; one that differs from what ``options``
            says is an error, not a silent choice.

    Returns:
        The prepared model (a peft model when LoRA is on), with ``model.tightfit_info``.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad options or model, before any change.
            Only the planner's checks (a ``checkpoint_budget`` no plan meets) run once the
            model is quantized; their error then carries a note that the module passed in
            was changed in place and must be loaded again (a folder path is loaded afresh).
    """
    return _prepare(model_or_path, PrepareOptions.merged(options, overrides), lora, example,
                    device)


def _prepare(
    model_or_path: nn.Module | str | os.PathLike[str],
    options: PrepareOptions,
    lora: LoraOptions | Mapping[str, Any] | Literal[False] | None,
    example: Mapping[str, Any] | torch.Tensor | None,
    device: torch.device | str | None,
) -> nn.Module:
    """:func:`prepare` once its keyword arguments are one :class:`PrepareOptions`."""
    # -- 1. check everything before anything changes --------------------------------------
    lora_opts = None if lora is False else (LoraOptions.coerce(lora) or LoraOptions())
    dev, cdtype = _check_device_and_policy(options, device)
    model = _take_model(model_or_path)
    targets, expert_targets = _check_model(model, options, lora_opts)
    check_inputs(model, example, options.offload_dir)
    if options.resident_layers not in ("all", "auto"):  # more layers than the model has: first
        check_resident_layers(options.resident_layers, len(find_blocks(model)))
    info = PrepareInfo(options, lora_opts, dev, cdtype, adapted=targets + expert_targets)
    info.base_numel = sum(p.numel() for p in model.parameters())

    try:
        return _change(model, options, lora_opts, targets, expert_targets, example, dev, info)
    except Exception as exc:
        if model is model_or_path:  # the caller's module, changed in place by now
            changed = ["its base frozen"]
            changed += [f"its linears in {options.quant}"] if options.quant else []
            changed += ["LoRA adapters added"] if lora_opts is not None else []
            exc.add_note(
                f"prepare() had already changed the model passed to it in place "
                f"({', '.join(changed)}): load it again before the next try (a model folder "
                "path is loaded afresh by each call)"
            )
        raise


def _change(
    model: nn.Module,
    options: PrepareOptions,
    lora_opts: LoraOptions | None,
    targets: list[str],
    expert_targets: list[str],
    example: Mapping[str, Any] | torch.Tensor | None,
    dev: torch.device,
    info: PrepareInfo,
) -> nn.Module:
    """Steps 2-5 of :func:`prepare`, once everything that can be checked up front was."""
    # -- 2. frozen base, 4-bit linears and experts; 3. LoRA -----------------------------
    info.quantized = quantize_base(
        model, quant=options.quant, double_quant=options.double_quant,
        blocksize=options.blocksize, compute_dtype=info.compute_dtype, device=dev,
        train_base=lora_opts is None and options.quant is None)  # fmt: skip
    if lora_opts is not None:
        model = add_lora(model, lora_opts, targets, expert_targets, info.compute_dtype)
    info.notes += coverage_notes(model, quantized=options.quant is not None,
                                 adapted=lora_opts is not None)
    if options.resident_layers not in ("all", "auto"):  # before the plan: it sees the room left
        pager = enable_paged_base(model, options.resident_layers, spill_dir=options.offload_dir)
        info.notes.append(f"paged base weights: {options.resident_layers} decoder layers "
                          f"resident, {pager.streamed_bytes} bytes on the next tier")

    # -- 4. chunked LM head + loss (first: the planner then profiles the chunked head) ---------
    info.loss_chunks = _apply_loss_chunks(model, options.loss_chunks, info.notes)

    # -- 5. checkpoint plan (with offload, tiled MLPs and a sized chunk for a long step) ----
    plan_step(model, info, example)
    model.tightfit_info = info  # type: ignore[assignment]
    return model


def plan_step(model: nn.Module, info: PrepareInfo,
              example: Mapping[str, Any] | torch.Tensor | None) -> None:
    """Step 5 of :func:`prepare`: install the activation plan of ``info.options`` for
    ``example`` (checkpoint, and offload, tiled MLPs and a sized loss chunk when a long step
    needs them) and record it in ``info``. A benchmark that replans one prepared model for
    several lengths calls it again after undoing the last plan."""
    options, lora = info.options, info.lora
    adapters = Adapters(
        lora_rank=lora.r if lora is not None else 0,
        lora_dropout=lora.dropout if lora is not None else 0.0,
        base="4bit" if options.quant else ("frozen" if lora is not None else "trainable"))
    activations = plan_activations(
        model, example, info.device, checkpoint=options.checkpoint,
        checkpoint_budget=options.checkpoint_budget, offload=options.offload,
        offload_host_budget=options.offload_host_budget, offload_dir=options.offload_dir,
        mlp_tile=options.mlp_tile, loss_chunks=options.loss_chunks,  # type: ignore[arg-type]
        compute_dtype=info.compute_dtype, adapters=adapters, room=machine_room(info.device))
    info.plan, info.tiling = activations.plan, activations.tiling
    if activations.loss_chunks is not None:
        info.loss_chunks = activations.loss_chunks
    info.notes += activations.notes


def _check_device_and_policy(
    options: PrepareOptions, device: torch.device | str | None
) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype, once the device exists and the policy parses."""
    dev = _auto_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; pass device='cpu'.")
    if options.checkpoint not in (None, "none"):
        parse_policy(options.checkpoint)  # raises ValueError naming the valid policies
    return dev, options.torch_compute_dtype(dev)


def _take_model(model_or_path: nn.Module | str | os.PathLike[str]) -> nn.Module:
    if isinstance(model_or_path, (str, os.PathLike)):
        return load_causal_lm(model_or_path)
    if isinstance(model_or_path, nn.Module):
        return model_or_path
    raise TypeError(
        f"prepare() takes an nn.Module or a model folder path, got "
        f"{type(model_or_path).__name__}."
    )


def add_lora(
    model: nn.Module, lora: LoraOptions, targets: list[str], expert_targets: list[str],
    compute_dtype: torch.dtype,
) -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters on the layers ``targets`` and the MoE
    expert weights ``expert_targets`` (peft's parameter targets), their matmuls in
    ``compute_dtype`` unless ``lora.compute`` says the adapters' own dtype.

    The one way adapters are added: :func:`prepare`'s step 3, and the FSDP2 loader's on the
    meta model (:mod:`tightfit.distributed.sharded_load`), so both train the same adapters.
    """
    # peft (and expert_lora, which subclasses its layer) cost seconds to import: only when
    # adapters are added, so `import tightfit.qlora.prepare` stays quick for the planner
    from peft import LoraConfig, get_peft_model

    from tightfit.qlora.expert_lora import custom_modules
    from tightfit.qlora.lora_compute import compute_in_compute_dtype

    cfg = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=expert_targets or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # 4-bit experts: peft's ParamWrapper, adapting each expert's 4-bit matmul
    # (full-precision experts keep peft's own, which parametrizes the weight)
    if custom := custom_modules(model):
        cfg._register_custom_module(custom)
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` property; the
        # FutureWarning is about peft's code, not the user's, so it is only noise here.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        # fp32 adapters by default (peft's autocast_adapter_dtype); a 16-bit lora.dtype as
        # the QLoRA paper's scripts (peft makes them fp32 beside a 4-bit base: cast here)
        peft_model = get_peft_model(model, cfg, autocast_adapter_dtype=lora.dtype == "float32")
    if lora.dtype != "float32":
        dtype = torch_dtype(lora.dtype)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(dtype)
    if lora.compute == "compute_dtype":
        # the matmuls in the compute dtype on the master weights (lora_compute's docstring)
        compute_in_compute_dtype(peft_model, compute_dtype)
    return peft_model


def _apply_loss_chunks(model: nn.Module, chunks: int | str | None, notes: list[str]) -> Any:
    if chunks is None:
        return None
    enable_chunked_loss(model, chunk_tokens=chunks)  # type: ignore[arg-type]
    return chunks
