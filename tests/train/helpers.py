"""Tiny models, tokenizers and data files for the train tests, made here (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A chat template without generation markers: assistant turns are found as what each adds.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIALS = ["[UNK]", "[PAD]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def tiny_llama(folder: Path, vocab_size: int = 256, positions: int = 64, *,
               tokenizer: bool = False) -> Path:
    """A 2-layer Llama with random weights, saved with ``save_pretrained`` (with
    :func:`byte_tokenizer` beside it when ``tokenizer``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=positions, tie_word_embeddings=False,
                      attn_implementation="sdpa")  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:
        byte_tokenizer().save_pretrained(folder)
    return folder


def tiny_run_args(save_every: int) -> list[str]:
    """``tightfit train`` options for a seconds-long run of the whole stack on
    :func:`tiny_llama` (NF4, LoRA r=4, checkpointing, PagedAdamW paging under a 16 KiB budget,
    no LoRA dropout, byte tokens), saving every ``save_every`` steps."""
    return ["--batch-size", "4", "--seq-len", "16", "--save-every", str(save_every),
            "--track-every", "0", "--checkpoint", "uniform:2", "--device", "cpu",
            "--page-bytes", "4KiB", "--device-budget", "16KiB", "--lora-r", "4",
            "--lora-alpha", "8", "--lora-dropout", "0", "--lr", "2e-3", "--tokenizer", "bytes"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what a byte-level BPE's vocabulary holds)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():  # noqa: ANN201
    """A Hugging Face fast tokenizer whose ids are the UTF-8 bytes (as the built-in byte
    tokenizer's), for a tiny model folder that has a tokenizer of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({c: b for b, c in _bytes_to_unicode().items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def word_tokenizer(words: list[str], template: str | None = CHAT_TEMPLATE):  # noqa: ANN201
    """A whitespace word-level fast tokenizer over ``words`` (+ the chat specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIALS + words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="<|end|>", additional_special_tokens=SPECIALS[2:])
    if template is not None:
        fast.chat_template = template
    return fast


def chat_model(folder: Path, words: list[str], template: str | None = CHAT_TEMPLATE) -> Path:
    """A tiny Llama folder with a word-level tokenizer (and a chat template unless ``None``)."""
    tok = word_tokenizer(words, template)
    tiny_llama(folder, vocab_size=len(tok))
    tok.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
