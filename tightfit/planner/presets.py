"""The shape of a causal LM: from a local HF ``config.json`` or a built-in preset.

The memory model needs only the architecture's sizes, never its weights. Presets are the
published configurations (the numbers in each model's ``config.json`` on the Hub), written
here as data so that ``tightfit plan --model llama-2-7b`` works offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-family decoder-only causal LM (Llama, Mistral, Qwen2).

    Attributes:
        name: Preset name or the config file it came from.
        hidden: Hidden size h.
        intermediate: MLP intermediate size.
        layers: Number of decoder layers.
        heads: Attention (query) heads.
        kv_heads: Key/value heads (fewer than ``heads`` under grouped-query attention).
        vocab: Vocabulary size (rows of the embedding and the LM head).
        tie_embeddings: The LM head shares the embedding matrix.
        head_dim: Per-head size (``hidden // heads`` unless the config says otherwise).
        qkv_bias: q/k/v projections have a bias (Qwen2).
        max_positions: Longest sequence the position embedding supports.
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int = 0
    qkv_bias: bool = False
    max_positions: int = 4096

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"model {self.name!r}: {field} must be a positive integer, got {value!r}; "
                    "check the config."
                )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads={self.heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}; check the config."
            )
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"model {self.name!r}: hidden_size={self.hidden} is not divisible by "
                    f"num_attention_heads={self.heads}; give head_dim in the config."
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_size(self) -> int:
        """Width of the query projection's output."""
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each linear layer in one decoder layer."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def num_params(self) -> int:
        """Total parameter count (embeddings, layers, norms, head)."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head


def _p(name: str, h: int, i: int, n: int, heads: int, kv: int, vocab: int, **kw) -> ModelShape:
    return ModelShape(name, h, i, n, heads, kv, vocab, **kw)


# Published configurations (config.json on the Hugging Face Hub of each model).
PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _p("llama-7b", 4096, 11008, 32, 32, 32, 32000, max_positions=2048),
        _p("llama-13b", 5120, 13824, 40, 40, 40, 32000, max_positions=2048),
        _p("llama-30b", 6656, 17920, 60, 52, 52, 32000, max_positions=2048),
        _p("llama-65b", 8192, 22016, 80, 64, 64, 32000, max_positions=2048),
        _p("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
        _p("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
        _p("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
        _p("llama-3-8b", 4096, 14336, 32, 32, 8, 128256, max_positions=8192),
        _p("llama-3-70b", 8192, 28672, 80, 64, 8, 128256, max_positions=8192),
        _p("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, max_positions=131072),
        _p("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128256, max_positions=131072),
        _p("llama-3.3-70b", 8192, 28672, 80, 64, 8, 128256, max_positions=131072),
        _p("mistral-7b", 4096, 14336, 32, 32, 8, 32000, max_positions=32768),
        _p("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, tie_embeddings=True, qkv_bias=True,
           max_positions=32768),
        _p("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, tie_embeddings=True, qkv_bias=True,
           max_positions=32768),
        _p("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, qkv_bias=True, max_positions=32768),
        _p("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, qkv_bias=True, max_positions=32768),
        _p("qwen2.5-32b", 5120, 27648, 64, 40, 8, 152064, qkv_bias=True, max_positions=32768),
        _p("qwen2.5-72b", 8192, 29568, 80, 64, 8, 152064, qkv_bias=True, max_positions=32768),
    )
}

# model_type values whose decoder layer is the Llama layer (RMSNorm, rotary, GQA, SwiGLU).
_LLAMA_FAMILY = {"llama", "mistral", "qwen2"}
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    """Read a :class:`ModelShape` from the dict of an HF ``config.json``.

    Raises:
        ValueError: A key is missing or has the wrong type, or the architecture is not a
            Llama-family causal LM.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object (an HF config.json), got {type(config).__name__}.")
    model_type = config.get("model_type")
    if model_type is not None and model_type not in _LLAMA_FAMILY:
        raise ValueError(
            f"{name}: model_type {model_type!r} is not modelled; tightfit plan knows the "
            f"Llama-family decoder ({', '.join(sorted(_LLAMA_FAMILY))})."
        )
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ValueError(
            f"{name}: missing {', '.join(missing)}; a causal-LM config.json needs "
            f"{', '.join(_REQUIRED)}."
        )
    heads = config["num_attention_heads"]
    return ModelShape(
        name=name,
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        vocab=config["vocab_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim") or 0,
        qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        max_positions=int(config.get("max_position_embeddings", 4096)),
    )


def load_shape(model: str | Path | ModelShape | dict) -> ModelShape:
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
            "or pass the path of a local HF config.json."
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); pass an HF config.json.") from exc
    return shape_from_config(config, name=str(path))
