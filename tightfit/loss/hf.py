"""Make a Hugging Face causal LM compute its loss in chunks, without editing its code.

:func:`enable_chunked_loss` gives the ``*ForCausalLM`` module (found inside a peft
``PeftModel`` too) an instance-level ``forward``. When ``labels`` are passed it runs the
backbone (``model.model`` for Llama: ``base_model_prefix``) for the hidden states and then
:func:`~tightfit.loss.chunked.chunked_cross_entropy` on the output head; the returned
``CausalLMOutputWithPast`` has ``loss`` and ``logits=None`` (the full logits are exactly what
is never built). Without ``labels`` — generation — the original forward runs unchanged, and
so it does when the caller needs the logits: in eval mode (``model.eval()``: HF Trainer's
``evaluate()`` hands them to ``compute_metrics``; switch it off with
``enable_chunked_loss(..., eval_logits=False)``) or when a call passes
``return_logits=True`` (``return_logits=False`` keeps the chunked loss in any mode). :func:`disable_chunked_loss` removes the instance attribute
(or puts back the one that was there), so the model is exactly as before.

Logit transforms the architecture applies before its loss (Gemma 2's
``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``) are read
from the config and applied per chunk (:mod:`tightfit.loss.transform`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tightfit.loss.chunked import chunked_cross_entropy
from tightfit.loss.router import RouterLoss, router_loss_of
from tightfit.loss.sizing import (
    auto_chunk_tokens,
    head_compute_dtype,
    head_kind_of,
    predict_head_loss_bytes,
)
from tightfit.loss.transform import LogitTransform

_ATTR = "_tightfit_chunked_loss"


@dataclass
class _Patch:
    """What enable() changed on the causal-LM module, so disable() can undo exactly that."""

    had_forward: bool
    saved_forward: Any
    chunk_tokens: int | Literal["auto"]
    budget: int | None
    transform: LogitTransform
    router: RouterLoss | None  # a MoE model's load-balancing loss, added like its forward
    eval_logits: bool = True  # eval mode runs the original forward: metrics need the logits


def enable_chunked_loss(
    model: nn.Module,
    chunk_tokens: int | Literal["auto"] = "auto",
    *,
    budget: int | None = None,
    eval_logits: bool = True,
) -> None:
    """Compute an HF causal LM's ``loss`` in chunks of tokens whenever ``labels`` are passed.

    Args:
        model: A transformers ``*ForCausalLM`` model, or a peft ``PeftModel`` around one.
        chunk_tokens: Tokens per chunk, or ``"auto"`` to choose per batch with
            :func:`~tightfit.loss.sizing.auto_chunk_tokens` from the batch shape, the
            vocabulary, the dtype and ``budget``.
        budget: With ``"auto"``: bytes allowed for one chunk's logits and their copies.
        eval_logits: In eval mode (``model.training`` is False) run the original forward, so
            ``outputs.logits`` is there for metrics (HF Trainer's ``evaluate()`` with
            ``compute_metrics``); ``False`` keeps the chunked loss (and ``logits=None``) in
            eval too. A call's ``return_logits=True``/``False`` overrides it either way.

    Raises:
        TypeError: ``model`` is not an HF causal LM (nor a PeftModel around one).
        ValueError: Bad ``chunk_tokens``/``budget``, a prompt-learning peft model, or an
            architecture whose logit transform is not known to be computable per chunk (see
            :func:`logit_transform_of`).

    Calling it again replaces the settings. With labels (in training mode, or with
    ``eval_logits=False``), ``outputs.logits`` is ``None``.
    """
    if not isinstance(eval_logits, bool):
        raise TypeError(f"eval_logits must be True or False, got {eval_logits!r}.")
    if chunk_tokens != "auto" and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise ValueError(f"chunk_tokens must be a positive int or 'auto', got {chunk_tokens!r}.")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be a positive number of bytes or None, got {budget!r}.")
        if chunk_tokens != "auto":
            raise ValueError(
                "budget only applies to chunk_tokens='auto'; pass one or the other, not both."
            )
    lm = _causal_lm(model)
    transform = logit_transform_of(lm)  # raises on a bad value, before any change
    _backbone(lm)  # raises before any change if there is none
    signature = inspect.signature(type(lm).forward)
    router = router_loss_of(lm, signature)
    disable_chunked_loss(model)

    patch = _Patch(
        had_forward="forward" in lm.__dict__,
        saved_forward=lm.__dict__.get("forward"),
        chunk_tokens=chunk_tokens,
        budget=budget,
        transform=transform,
        router=router,
        eval_logits=eval_logits,
    )
    original = lm.forward

    @functools.wraps(type(lm).forward)
    def forward(*args: Any, return_logits: bool | None = None, **kwargs: Any) -> Any:
        if return_logits is None:
            return_logits = patch.eval_logits and not lm.training
        if return_logits:  # the caller needs the logits: HF's own forward builds them
            return original(*args, **kwargs)
        return _chunked_forward(lm, original, signature, patch, args, kwargs)

    lm.forward = forward
    setattr(lm, _ATTR, patch)


def disable_chunked_loss(model: nn.Module) -> None:
    """Undo :func:`enable_chunked_loss` exactly; a no-op when it is not enabled."""
    lm = _causal_lm(model)
    patch = lm.__dict__.get(_ATTR)
    if patch is None:
        return
    if patch.had_forward:
        lm.forward = patch.saved_forward
    else:
        del lm.forward
    delattr(lm, _ATTR)


def is_chunked_loss_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable_chunked_loss` is in effect on ``model``."""
    return _ATTR in _causal_lm(model).__dict__


def predict_model_head_loss_bytes(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int,
    chunk_tokens: int | Literal["auto"] | None = "auto",
    budget: int | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """:func:`~tightfit.loss.sizing.predict_head_loss_bytes` for a model's own head.

    Args:
        model: An HF causal LM or a PeftModel around one.
        batch: Sequences per step.
        seq_len: Tokens per sequence.
        chunk_tokens: Tokens per chunk, ``"auto"`` (what :func:`enable_chunked_loss` with
            this ``budget`` would pick) or ``None`` for HF's unchunked loss.
        budget: With ``"auto"``, as in :func:`enable_chunked_loss`.
        dtype: Dtype of the hidden states; default: the head's compute dtype.
    """
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    kind = head_kind_of(head)
    dtype = dtype or head_compute_dtype(head)
    vocab = getattr(head, "out_features", None) or lm.config.vocab_size
    softcap = logit_transform_of(lm).softcap is not None
    if chunk_tokens == "auto":
        chunk_tokens = auto_chunk_tokens(vocab, seq_len, batch, dtype, budget, head_kind=kind,
                                         softcap=softcap)
    return predict_head_loss_bytes(
        vocab,
        seq_len,
        batch,
        dtype,
        hidden_size=lm.config.hidden_size,
        chunk_tokens=chunk_tokens,
        trainable_head_numel=sum(p.numel() for p in head.parameters() if p.requires_grad),
        head_kind=kind,
        softcap=softcap,
    )


def _causal_lm(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an HF causal LM (nn.Module), got {type(model).__name__}.")
    lm = model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        config = getattr(model, "active_peft_config", None)
        if getattr(config, "is_prompt_learning", False):
            raise ValueError(
                "prompt-learning peft models (prefix/prompt tuning) rewrite the inputs and "
                "labels in their own forward; chunked loss supports adapter methods like LoRA."
            )
        lm = get_base()
    if not hasattr(lm, "config") or not callable(getattr(lm, "get_output_embeddings", None)):
        raise TypeError(
            f"{type(lm).__name__} is not a transformers causal LM; pass the *ForCausalLM "
            "model (or the PeftModel wrapping it)."
        )
    if not isinstance(lm.get_output_embeddings(), nn.Module):
        raise TypeError(
            f"{type(lm).__name__} has no output head (get_output_embeddings() is None)."
        )
    return lm


def _backbone(lm: nn.Module) -> nn.Module:
    backbone = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if not isinstance(backbone, nn.Module) or backbone is lm:
        raise TypeError(
            f"{type(lm).__name__} has no backbone at base_model_prefix="
            f"{getattr(lm, 'base_model_prefix', None)!r}; chunked loss needs the usual "
            "<backbone> + lm_head layout of transformers causal LMs."
        )
    return backbone


# How each family transforms its logits before the loss, read from its modeling code: the
# same config field means different things elsewhere (HyperCLOVA X multiplies by
# logits_scaling, MPT ignores logit_scale), so it is by model_type, never by field name.
_SOFTCAP = ("gemma2", "gemma3_text", "vaultgemma", "nanochat")  # cap * tanh(z / cap)
_TIMES_LOGIT_SCALE = ("cohere", "cohere2", "cohere2_moe")  # z * logit_scale
_OVER_LOGITS_SCALING = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                        "granite_swa")  # z / logits_scaling
_FIELDS = {"final_logit_softcapping": (None,), "logit_scale": (None, 1, 1.0),
           "logits_scaling": (None, 1, 1.0)}


def logit_transform_of(model: nn.Module) -> LogitTransform:
    """The transform a causal LM applies to its logits before the loss, from its config.

    Gemma 2/3, VaultGemma and nanochat soft-cap (``final_logit_softcapping``), Cohere scales
    by ``logit_scale``, Granite divides by ``logits_scaling``.

    Raises:
        ValueError: Another family has one of these fields set: its head is not known to
            be computable per chunk; leave chunked loss off for it.
    """
    lm = _causal_lm(model)
    cfg = lm.config
    kind = getattr(cfg, "model_type", None)
    known = {
        "final_logit_softcapping": _SOFTCAP,
        "logit_scale": _TIMES_LOGIT_SCALE,
        "logits_scaling": _OVER_LOGITS_SCALING,
    }
    for name, neutral in _FIELDS.items():
        value = getattr(cfg, name, None)
        if value not in neutral and kind not in known[name]:
            raise ValueError(
                f"{type(lm).__name__} ({kind!r}) has config.{name}={value!r}, a transform of "
                "its logits that the chunked loss applies only for "
                f"{', '.join(known[name])}; leave chunked loss off for this model."
            )
    scale, cap = 1.0, getattr(cfg, "final_logit_softcapping", None)
    if kind in _TIMES_LOGIT_SCALE:
        scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if kind in _OVER_LOGITS_SCALING:
        scale = 1.0 / float(getattr(cfg, "logits_scaling", None) or 1.0)
    # LogitTransform refuses a cap or scale that is not a positive number
    return LogitTransform(scale=scale, softcap=None if cap is None else float(cap))


def _chunked_forward(
    lm: nn.Module,
    original: Any,
    signature: inspect.Signature,
    patch: _Patch,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    bound = signature.bind(lm, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    if arguments.get("labels") is None:
        return original(*args, **kwargs)

    labels = arguments.pop("labels")
    return_dict = arguments.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(lm.config, "return_dict", True)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    with_router = patch.router is not None and patch.router.wanted(lm, arguments)
    if patch.router is not None:
        arguments["output_router_logits"] = with_router  # as HF's forward passes it on
    # The rest goes to the backbone, as HF's own forward passes it (num_items_in_batch etc.
    # included: the backbone ignores what it does not use).
    outputs = _backbone(lm)(**arguments)
    hidden = outputs[0]
    if isinstance(logits_to_keep, int):
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
    else:
        hidden = hidden[:, logits_to_keep, :]

    head = lm.get_output_embeddings()
    chunk = patch.chunk_tokens
    if chunk == "auto":
        seq = hidden.shape[-2]
        chunk = auto_chunk_tokens(
            getattr(head, "out_features", None) or lm.config.vocab_size,
            seq,
            hidden.numel() // (seq * hidden.shape[-1]),
            hidden.dtype,
            patch.budget,
            head_kind=head_kind_of(head),
            softcap=patch.transform.softcap is not None,
        )
    shift_labels = arguments.get("shift_labels")
    loss = chunked_cross_entropy(
        hidden,
        head,
        labels if shift_labels is None else shift_labels,
        chunk_tokens=chunk,
        ignore_index=arguments.get("ignore_index", -100),
        shift=shift_labels is None,
        num_items_in_batch=arguments.get("num_items_in_batch"),
        transform=patch.transform,
    )
    from transformers import modeling_outputs as mo  # heavy; only when used

    common = {
        "logits": None,
        "past_key_values": getattr(outputs, "past_key_values", None),
        "hidden_states": getattr(outputs, "hidden_states", None),
        "attentions": getattr(outputs, "attentions", None),
    }
    if patch.router is None:
        out = mo.CausalLMOutputWithPast(loss=loss, **common)
    else:
        aux = None
        if with_router:
            loss, aux = patch.router.add(lm, loss, outputs, arguments.get("attention_mask"))
        out = mo.MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux, router_logits=getattr(outputs, "router_logits", None),
            **common)
    return out if return_dict else out.to_tuple()
