"""Block discovery finds the decoder layers structurally (HF, peft, Sequential)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import tightfit.checkpoint as ck
from tightfit.model.blocks import resolve_blocks

from ..checkpoint.conftest import tiny_llama


def test_finds_hf_decoder_layers_plain_and_under_peft() -> None:
    model = tiny_llama(layers=3)
    assert ck.find_blocks(model) == list(model.model.layers)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert ck.find_blocks(wrapped) == list(model.model.layers)


def test_sequential_and_nested_lists() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert ck.find_blocks(seq) == list(seq)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)])
            self.big = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])

    net = Net()
    assert ck.find_blocks(net) == list(net.big)  # the list holding the most parameters


def test_resolve_rejects_bad_blocks() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="twice"):
        resolve_blocks(seq, [seq[0], seq[0]])
    with pytest.raises(TypeError, match="nn.Module"):
        resolve_blocks(seq, [torch.zeros(1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty"):
        resolve_blocks(seq, [])
