"""Tiny models shared by the checkpoint tests (built from configs; nothing downloaded)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(layers: int = 6, hidden: int = 32, dropout: float = 0.0, vocab: int = 128,
               heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads,
                      attention_dropout=dropout, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


@pytest.fixture(autouse=True)
def _quiet_use_cache_warning() -> None:
    warnings.filterwarnings("ignore", message="tightfit.checkpoint: setting model.config")
    warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # These models are tiny: on a shared, loaded machine intra-op threads only spin-wait
    # (measured 10-20x slower with 2 threads at load 10). Restored after each test.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def loss_and_grads(model: torch.nn.Module, batch: dict, seed: int = 1,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward under a fixed seed; the loss and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads
