"""Long-step planning's refusals name the limit that binds, in readable sizes (issue 28 item
10: a 1 GiB cgroup read as "1 byte the step may use (the memory free on this machine)")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.checkpoint.long_step import MARGIN_BYTES, Room, step_capacity


def test_no_room_left_is_refused_naming_the_limit_and_each_part() -> None:
    model = nn.Linear(1024, 1024)  # 1M trainable params: 12 MiB of grads and AdamW state
    limit = "the memory cgroup's limit (1.00 GiB) less the 900 MiB this process uses"
    with pytest.raises(ValueError) as e:
        step_capacity(model, torch.device("cpu"), Room(72 << 20, limit))
    said = str(e.value)
    assert said.startswith("no room is left for a step's activations: the memory cgroup's limit")
    assert "leaves 72" in said and "take 12.0 MiB" in said and "margin of" in said
    assert " 1 " not in said and "bytes" not in said  # no raw or one-byte budget


def test_the_room_left_is_what_the_step_may_use() -> None:
    model = nn.Linear(4, 4)
    room = Room(1 << 30, "the RAM available (MemAvailable)")
    got = step_capacity(model, torch.device("cpu"), room)
    trainable = 20 * (4 + 8)
    assert got == (1 << 30) - trainable - int(0.05 * (1 << 30) + MARGIN_BYTES["cpu"])
