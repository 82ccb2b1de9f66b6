"""Step counts and tensor hyperparameters as host values, read once per optimizer step.

The step counters live on the params' device (torch's fused kernels read them there). The
non-fused updates need them as numbers (bias corrections), bitsandbytes' 8-bit kernel too,
and a tensor ``lr`` becomes a number for torch's foreach kernels and for SGD. Read per update
call, each of those is a device sync per bucket (per streamed page), stalling the copies
behind it. :class:`HostReads` reads every count of the step with one ``torch.stack(...)
.tolist()`` the first time one is asked for (the fused default never asks), and each tensor
hyperparameter once per step. It is the optimizer's own, not part of the view cache, so page
moves (which empty that cache) cost no read.
"""

from __future__ import annotations

from typing import Any

import torch


class HostReads:
    """What one optimizer step reads from the device, read once for the step."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []
        self._counts: dict[int, float] = {}  # by id of a step tensor (held in _steps)
        self._scalars: dict[tuple[int, str], tuple[torch.Tensor, Any]] = {}  # by tensor id, kind

    def begin(self, steps: list[torch.Tensor]) -> None:
        """A step starts: ``steps`` are its params' step tensors (already incremented)."""
        self._steps, self._counts, self._scalars = steps, {}, {}

    def clear(self) -> None:
        """The step tensors were replaced (a state load): read them afresh."""
        self.begin([])

    def counts(self, steps: list[torch.Tensor]) -> list[float]:
        """Each step tensor's count (one read of all of the step's counts, the first time)."""
        c = self._counts
        if any(id(s) not in c for s in steps):
            known = {id(s) for s in self._steps}
            every = self._steps + [s for s in steps if id(s) not in known]
            self._steps = every  # holds them: their ids stay theirs for the step
            c = self._counts = dict(zip(map(id, every), _read(every)))
        return [c[id(s)] for s in steps]

    def scalar(self, value: Any) -> float:
        """A hyperparameter as a number (a tensor read once per step)."""
        if not isinstance(value, torch.Tensor):
            return float(value)
        return self._cached(value, "number", lambda: float(value.item()))

    def on_host(self, value: Any) -> Any:
        """A tensor hyperparameter on the CPU (a device tensor copied once per step), for
        torch's math that takes it as a tensor; numbers and CPU tensors as they are."""
        if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
            return value
        return self._cached(value, "cpu", value.cpu)

    def _cached(self, value: torch.Tensor, kind: str, read: Any) -> Any:
        key = (id(value), kind)
        hit = self._scalars.get(key)
        if hit is None or hit[0] is not value:
            hit = self._scalars[key] = (value, read())
        return hit[1]


def _read(steps: list[torch.Tensor]) -> list[float]:
    """The counts of ``steps`` as numbers: one read per device."""
    out: dict[int, float] = {}
    for device in {s.device for s in steps}:
        mine = [s for s in steps if s.device == device]
        out.update(zip(map(id, mine), torch.stack(mine).tolist()))
    return [out[id(s)] for s in steps]
