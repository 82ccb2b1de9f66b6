"""The built-in model of ``tightfit train``: a small Llama-architecture causal LM from a config.

Nothing is downloaded, so it starts from random weights: the run shows the memory stack
working and the loss falling as the LoRA adapters learn the corpus' byte statistics, not a
useful language model. ``--model DIR`` trains a real local checkpoint instead.
"""

from __future__ import annotations

from torch import nn

BUILTIN_NAME = "builtin-llama-tiny"
RANDOM_WEIGHTS_NOTE = (
    "The built-in model is a small Llama-architecture model created from a config: it starts "
    "from RANDOM weights (nothing is downloaded). Pass --model DIR to fine-tune a real local "
    "Hugging Face model."
)


def builtin_config(vocab_size: int = 256, max_positions: int = 1024):  # noqa: ANN201
    """The built-in model's ``LlamaConfig`` (about 0.9 M parameters, byte vocabulary)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def builtin_model(vocab_size: int = 256) -> nn.Module:
    """A freshly initialised built-in model (seed torch first for reproducible weights)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(builtin_config(vocab_size))


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's config allows, when it says."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
