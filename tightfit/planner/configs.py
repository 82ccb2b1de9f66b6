"""A :class:`~tightfit.planner.shapes.ModelShape` from an HF ``config.json``, per family.

Each modelled ``model_type`` is read with transformers' own defaults for the keys a config
may leave out (``max_position_embeddings``, ``head_dim``, ``tie_word_embeddings``, the
sliding window and which layers use it, Gemma 2's soft-caps); ``tests/planner`` checks the
reading against transformers' config classes and the parameter count against the model
transformers builds from the same config. Gemma 3's multimodal configs (``model_type``
``gemma3`` with a ``text_config``) are read for their text decoder only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tightfit.planner.shapes import FAMILIES, FULL, SLIDING, ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# model_type -> family, where transformers' name differs
_ALIASES = {"gemma3_text": "gemma3"}
# transformers' defaults for keys a config.json may omit
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                  "gemma": 8192, "gemma2": 8192, "gemma3": 131072, "phi3": 4096,
                  "mixtral": 131072, "qwen3_moe": 32768}
# (Qwen3-MoE's is hidden / heads: its config class has no head_dim default)
_HEAD_DIM = {"gemma": 256, "gemma2": 256, "gemma3": 256, "qwen3": 128}
# num_key_value_heads where the config class defaults it to a number (else: the heads)
_KV_HEADS = {"mistral": 8, "mixtral": 8, "qwen2": 32, "qwen3": 32, "qwen3_moe": 4,
             "gemma": 16, "gemma2": 4, "gemma3": 4}
_TIED = {"gemma", "gemma2", "gemma3"}


def family_of(config: dict[str, Any], name: str) -> str:
    """The modelled family of a config's ``model_type`` (``None``: the Llama layer).

    Raises:
        ValueError: Another ``model_type``; the message lists the modelled ones.
    """
    model_type = config.get("model_type") or "llama"
    family = _ALIASES.get(model_type, model_type)
    if family not in FAMILIES:
        known = sorted({*FAMILIES, *_ALIASES})
        raise ValueError(
            f"{name}: model_type {model_type!r} is not modelled; tightfit plan knows "
            f"{', '.join(known)}. Pass a config of one of these (or a preset)."
        )
    return family


def _sliding(config: dict[str, Any], family: str,
             layers: int) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers sets them for the family."""
    window = config.get("sliding_window", 4096 if family in ("mistral", "gemma2", "gemma3")
                        else None)
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if not config.get("use_sliding_window", False):
            return None, ()
        start = int(config.get("max_window_layers", 28))
        default = tuple(SLIDING if i >= start else FULL for i in range(layers))
    elif family == "gemma2":
        default = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers))
    elif family == "gemma3":
        pattern = int(config.get("sliding_window_pattern", 6))
        default = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    elif family == "gemma":
        return None, ()
    else:
        default = ()  # every layer, when there is a window
    if window is None:
        return None, ()
    types = tuple(config.get("layer_types") or default)
    if types and SLIDING not in types:
        return None, ()
    return int(window), types


def _moe(config: dict[str, Any], family: str, name: str) -> dict[str, Any]:
    """Experts, top-k and the expert width of a MoE config (``{}`` for a dense family)."""
    if family == "mixtral":
        return {"experts": int(config.get("num_local_experts", 8)),
                "experts_per_token": int(config.get("num_experts_per_tok", 2))}
    if family != "qwen3_moe":
        return {}
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"{name}: dense MLP layers between the MoE layers (mlp_only_layers / "
            "decoder_sparse_step) are not modelled; the planner models every layer a MoE "
            "layer (as in the released Qwen3-MoE models). Pass such a config.")
    # transformers 5 writes num_experts as num_local_experts (its attribute_map)
    experts = config.get("num_experts", config.get("num_local_experts", 128))
    return {"experts": int(experts),
            "experts_per_token": int(config.get("num_experts_per_tok", 8)),
            "intermediate": int(config.get("moe_intermediate_size", 768))}


def shape_from_config(config: dict[str, Any], name: str = "config") -> ModelShape:
    """Read a :class:`ModelShape` from the dict of an HF ``config.json``.

    Raises:
        ValueError: A key is missing or has the wrong type, or the architecture is not a
            modelled family.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object (an HF config.json), got "
                         f"{type(config).__name__}.")
    family = family_of(config, name)
    if family == "gemma3" and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": "gemma3_text"}
    missing = [k for k in _REQUIRED if k not in config]
    moe = _moe(config, family, name)
    if family == "qwen3_moe" and "intermediate_size" in missing:
        missing.remove("intermediate_size")  # its experts' width is moe_intermediate_size
    if missing:
        raise ValueError(
            f"{name}: missing {', '.join(missing)}; a causal-LM config.json needs "
            f"{', '.join(_REQUIRED)}."
        )
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    window, types = _sliding(config, family, layers) if isinstance(layers, int) else (None, ())
    softcap = family in ("gemma2", "gemma3")
    return ModelShape(
        name=name,
        hidden=config["hidden_size"],
        intermediate=moe.pop("intermediate", config.get("intermediate_size")),
        layers=layers,
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or _KV_HEADS.get(family, heads),
        vocab=config["vocab_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", family in _TIED)),
        head_dim=config.get("head_dim") or _HEAD_DIM.get(family, 0),
        qkv_bias=bool(config.get("attention_bias", False)),
        max_positions=int(config.get("max_position_embeddings", _MAX_POSITIONS[family])),
        family=family,
        sliding_window=window,
        layer_types=types,
        attn_softcap=config.get("attn_logit_softcapping", 50.0 if family == "gemma2" else None)
        if softcap else None,
        final_softcap=config.get("final_logit_softcapping", 30.0 if family == "gemma2" else None)
        if softcap else None,
        **moe,
    )


def hf_config(shape: ModelShape) -> PretrainedConfig:
    """A transformers config of ``shape`` (random-weight models for ``--verify``, tests)."""
    import transformers

    family = shape.family
    kw: dict[str, Any] = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_embeddings, max_position_embeddings=shape.max_positions,
        use_cache=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    if family in ("llama", "qwen3", "gemma", "gemma2", "gemma3", "qwen3_moe"):
        kw["attention_bias"] = shape.qkv_bias
    if family in ("mistral", "phi3", "mixtral", "gemma2", "gemma3"):
        kw["sliding_window"] = shape.sliding_window
    if shape.sliding_window is not None and family in ("qwen2", "qwen3", "qwen3_moe"):
        kw.update(use_sliding_window=True, sliding_window=shape.sliding_window)
    if shape.layer_types:
        kw["layer_types"] = list(shape.layer_types)
    if family in ("gemma2", "gemma3"):
        kw.update(attn_logit_softcapping=shape.attn_softcap,
                  final_logit_softcapping=shape.final_softcap)
    if family == "mixtral":
        kw.update(num_local_experts=shape.experts, num_experts_per_tok=shape.experts_per_token)
    if family == "qwen3_moe":
        kw.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                  moe_intermediate_size=shape.intermediate, norm_topk_prob=True)
    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    config = transformers.AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "eager" if shape.eager_attention else "sdpa"
    return config
