"""Built-in model shapes, and :func:`load_shape` (a preset, a ``config.json`` or its folder).

The memory model needs only the architecture's sizes, never its weights. Presets are the
published configurations (the keys of each model's ``config.json`` on the Hub that the
planner reads, position limits included), written here as data and read by the same
:func:`~tightfit.planner.configs.shape_from_config` as a local config, so that ``tightfit
plan --model qwen3-8b`` works offline. Gemma 3's 4B/12B/27B presets are their text decoders
(the vision tower of those checkpoints, about 0.4 B parameters, is not counted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tightfit.planner.configs import hf_config, shape_from_config
from tightfit.planner.shapes import ModelShape

__all__ = ["PRESETS", "ModelShape", "hf_config", "load_shape", "shape_from_config"]


def _c(model_type: str, h: int, i: int, n: int, heads: int, kv: int, vocab: int,
       positions: int, **keys: Any) -> dict[str, Any]:
    """A config.json's planner keys (HF names) for :func:`shape_from_config`."""
    return {"model_type": model_type, "hidden_size": h, "intermediate_size": i,
            "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "max_position_embeddings": positions, **keys}


_QWEN2 = {"attention_bias": True}
_TIE = {"tie_word_embeddings": True}
_G2 = {"head_dim": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
       "final_logit_softcapping": 30.0}
_PHI3_4K = {"sliding_window": 2047}
_PHI3_128K = {"sliding_window": 262144}

# Published configurations (config.json on the Hugging Face Hub of each model).
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-7b": _c("llama", 4096, 11008, 32, 32, 32, 32000, 2048),
    "llama-13b": _c("llama", 5120, 13824, 40, 40, 40, 32000, 2048),
    "llama-30b": _c("llama", 6656, 17920, 60, 52, 52, 32000, 2048),
    "llama-65b": _c("llama", 8192, 22016, 80, 64, 64, 32000, 2048),
    "llama-2-7b": _c("llama", 4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-2-13b": _c("llama", 5120, 13824, 40, 40, 40, 32000, 4096),
    "llama-2-70b": _c("llama", 8192, 28672, 80, 64, 8, 32000, 4096),
    "llama-3-8b": _c("llama", 4096, 14336, 32, 32, 8, 128256, 8192),
    "llama-3-70b": _c("llama", 8192, 28672, 80, 64, 8, 128256, 8192),
    "llama-3.1-8b": _c("llama", 4096, 14336, 32, 32, 8, 128256, 131072),
    "llama-3.1-70b": _c("llama", 8192, 28672, 80, 64, 8, 128256, 131072),
    "llama-3.2-1b": _c("llama", 2048, 8192, 16, 32, 8, 128256, 131072, head_dim=64, **_TIE),
    "llama-3.2-3b": _c("llama", 3072, 8192, 28, 24, 8, 128256, 131072, head_dim=128, **_TIE),
    "llama-3.3-70b": _c("llama", 8192, 28672, 80, 64, 8, 128256, 131072),
    "mistral-7b": _c("mistral", 4096, 14336, 32, 32, 8, 32000, 32768, sliding_window=4096),
    "mistral-7b-v0.3": _c("mistral", 4096, 14336, 32, 32, 8, 32768, 32768, sliding_window=None),
    "mistral-nemo-12b": _c("mistral", 5120, 14336, 40, 32, 8, 131072, 1024000, head_dim=128,
                           sliding_window=None),
    "qwen2.5-0.5b": _c("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, **_QWEN2, **_TIE),
    "qwen2.5-1.5b": _c("qwen2", 1536, 8960, 28, 12, 2, 151936, 32768, **_QWEN2, **_TIE),
    "qwen2.5-3b": _c("qwen2", 2048, 11008, 36, 16, 2, 151936, 32768, **_QWEN2, **_TIE),
    "qwen2.5-7b": _c("qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, **_QWEN2),
    "qwen2.5-14b": _c("qwen2", 5120, 13824, 48, 40, 8, 152064, 32768, **_QWEN2),
    "qwen2.5-32b": _c("qwen2", 5120, 27648, 64, 40, 8, 152064, 32768, **_QWEN2),
    "qwen2.5-72b": _c("qwen2", 8192, 29568, 80, 64, 8, 152064, 32768, **_QWEN2),
    "qwen3-0.6b": _c("qwen3", 1024, 3072, 28, 16, 8, 151936, 40960, head_dim=128, **_TIE),
    "qwen3-1.7b": _c("qwen3", 2048, 6144, 28, 16, 8, 151936, 40960, head_dim=128, **_TIE),
    "qwen3-4b": _c("qwen3", 2560, 9728, 36, 32, 8, 151936, 40960, head_dim=128, **_TIE),
    "qwen3-8b": _c("qwen3", 4096, 12288, 36, 32, 8, 151936, 40960, head_dim=128),
    "qwen3-14b": _c("qwen3", 5120, 17408, 40, 40, 8, 151936, 40960, head_dim=128),
    "qwen3-32b": _c("qwen3", 5120, 25600, 64, 64, 8, 151936, 40960, head_dim=128),
    "qwen3-30b-a3b": _c("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, 40960, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _c("qwen3_moe", 4096, 12288, 94, 64, 4, 151936, 40960, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    "gemma-2b": _c("gemma", 2048, 16384, 18, 8, 1, 256000, 8192, head_dim=256),
    "gemma-7b": _c("gemma", 3072, 24576, 28, 16, 16, 256000, 8192, head_dim=256),
    "gemma-2-2b": _c("gemma2", 2304, 9216, 26, 8, 4, 256000, 8192, **_G2),
    "gemma-2-9b": _c("gemma2", 3584, 14336, 42, 16, 8, 256000, 8192, **_G2),
    "gemma-2-27b": _c("gemma2", 4608, 36864, 46, 32, 16, 256000, 8192, **{**_G2, "head_dim": 128}),
    "gemma-3-1b": _c("gemma3_text", 1152, 6912, 26, 4, 1, 262144, 32768, head_dim=256,
                     sliding_window=512),
    "gemma-3-4b": _c("gemma3_text", 2560, 10240, 34, 8, 4, 262208, 131072, head_dim=256,
                     sliding_window=1024),
    "gemma-3-12b": _c("gemma3_text", 3840, 15360, 48, 16, 8, 262208, 131072, head_dim=256,
                      sliding_window=1024),
    "gemma-3-27b": _c("gemma3_text", 5376, 21504, 62, 32, 16, 262208, 131072, head_dim=128,
                      sliding_window=1024),
    "phi-3-mini-4k": _c("phi3", 3072, 8192, 32, 32, 32, 32064, 4096, **_PHI3_4K),
    "phi-3-mini-128k": _c("phi3", 3072, 8192, 32, 32, 32, 32064, 131072, **_PHI3_128K),
    "phi-3-medium-4k": _c("phi3", 5120, 17920, 40, 40, 10, 32064, 4096, **_PHI3_4K),
    "phi-3-medium-128k": _c("phi3", 5120, 17920, 40, 40, 10, 32064, 131072, **_PHI3_128K),
    "phi-3.5-mini": _c("phi3", 3072, 8192, 32, 32, 32, 32064, 131072, **_PHI3_128K),
    "phi-4": _c("phi3", 5120, 17920, 40, 40, 10, 100352, 16384, sliding_window=None),
    "phi-4-mini": _c("phi3", 3072, 8192, 32, 24, 8, 200064, 131072, sliding_window=None, **_TIE),
    "mixtral-8x7b": _c("mixtral", 4096, 14336, 32, 32, 8, 32000, 32768, sliding_window=None,
                       num_local_experts=8, num_experts_per_tok=2),
    "mixtral-8x22b": _c("mixtral", 6144, 16384, 56, 48, 8, 32768, 65536, sliding_window=None,
                        num_local_experts=8, num_experts_per_tok=2),
}

PRESETS: dict[str, ModelShape] = {n: shape_from_config(c, name=n) for n, c in _CONFIGS.items()}


def model_folder(model: str | Path | ModelShape | dict[str, Any]) -> str | None:
    """The folder ``tightfit train --model`` takes for what :func:`load_shape` reads: a
    folder as given, the folder of a ``config.json``; ``None`` for a preset, a dict, a shape
    or another JSON file (no model folder is known)."""
    if not isinstance(model, str | Path) or str(model).strip().lower() in PRESETS:
        return None
    path = Path(model)
    if path.is_dir():
        return str(model)
    return str(path.parent) if path.name == "config.json" else None


def load_shape(model: str | Path | ModelShape | dict[str, Any]) -> ModelShape:
    """A model shape from a preset name, a ``config.json`` path (or its folder), or a dict.

    Raises:
        ValueError: Unknown preset (the known ones are listed) or a malformed config.
        FileNotFoundError: The path does not exist.
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return shape_from_config(model)
    key = str(model).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        if path.suffix == ".json" or "/" in str(model):
            raise FileNotFoundError(f"no such config file: {path}; pass a config.json or its folder.")
        raise ValueError(
            f"unknown model preset {str(model)!r}; known presets: {', '.join(PRESETS)}; "
            "or pass the path of a local HF config.json (or its folder)."
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); pass an HF config.json.") from exc
    return shape_from_config(config, name=str(path))
