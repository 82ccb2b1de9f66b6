"""A fine-grained trace of a fake device's usage, shared by the watch and occupancy tests."""

from __future__ import annotations

import torch
from torch import nn

from .fakes import FakeProbe


def sample_everywhere(model: nn.Module, probe: FakeProbe) -> None:
    """Read the probe around every leaf module, forward and backward: a fine-grained trace
    whose ``probe.peak_bytes`` sees what the watch's coarser checks may miss."""

    def grad_hook(grad: torch.Tensor) -> None:
        probe.used_bytes()

    def fwd(module: nn.Module, args: object, out: torch.Tensor) -> None:
        probe.used_bytes()
        if out.requires_grad:
            out.register_hook(grad_hook)

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(fwd)
