"""Synthetic chains whose memory and compute per block are known by construction."""

from __future__ import annotations

import torch
from torch import nn


class SavesOne(nn.Module):
    """``sin(x + b)``: saves exactly one input-sized tensor (the sum), not its input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x + self.b)


class MemoryHeavy(nn.Module):
    """Saves four input-sized tensors' worth and costs almost no compute."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(4 * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(torch.cat([x, x, x, x], -1) + self.b)  # sin saves the 4x-wide sum
        return h.view(*x.shape[:-1], 4, x.shape[-1]).sum(-2)


class ComputeHeavy(nn.Module):
    """Many matmuls, one input-sized tensor saved: slow to recompute, nothing to gain."""

    def __init__(self, d: int, rounds: int = 24) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer("m", torch.randn(d, d) / d**0.5)
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            k = x
            for _ in range(self.rounds):
                k = torch.tanh(k @ self.m)
        return x + k * self.scale  # the mul saves k (input-sized) for scale's grad
