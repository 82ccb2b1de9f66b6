"""Counting host reads of tensor values: what synchronizes a GPU.

On CUDA, ``.item()``, ``.tolist()``, ``float(t)``, a tensor passed where a number is expected
(``value=t``) block the host until the device has caught up. On the CPU nothing waits, but
the same calls happen, so counting them here shows what a GPU step would sync: every
``aten._local_scalar_dense`` (``.item()`` and the implicit conversions) and every
``Tensor.tolist()`` (which reads without dispatching).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls while active (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Inside: host reads are counted; yields a one-element list holding the count at exit."""
    tolists = [0]
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor):  # noqa: ANN202
        tolists[0] += 1
        return tolist(self)

    out = [0]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", counted)
        with HostReads() as mode:
            yield out
    out[0] = mode.count + tolists[0]
