"""A fake device for the tests: :class:`FakeProbe`, a capacity and a usage made of callables
(e.g. "live activation bytes + resident optimizer bytes"), deterministic on any machine."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tightfit.pressure.probes import Probe


class FakeProbe(Probe):
    """A test's device: a fake capacity and a usage summed from callables.

    Args:
        capacity_bytes: The fake device's capacity.
        sources: Callables returning bytes in use (e.g. ``lambda: tracker.current_bytes``);
            their sum plus ``base_bytes`` is the usage. More can be added with :meth:`add_source`.
        base_bytes: Constant usage (e.g. parameters and gradients).
        strict: Raise ``torch.OutOfMemoryError`` from any reading above the capacity, the way
            a real allocator fails; the reading is still recorded in :attr:`peak_bytes`.
        record: Keep every reading in :attr:`history` (for tests that want the whole trace).

    Raises:
        ValueError: ``capacity_bytes`` is not positive or ``base_bytes`` is negative.
    """

    def __init__(
        self,
        capacity_bytes: int,
        sources: Iterable[Callable[[], int]] = (),
        *,
        base_bytes: int = 0,
        strict: bool = False,
        record: bool = False,
    ) -> None:
        super().__init__()
        if int(capacity_bytes) <= 0:
            raise ValueError(
                f"FakeProbe capacity_bytes must be positive, got {capacity_bytes}; "
                "pass the fake device's size in bytes."
            )
        if int(base_bytes) < 0:
            raise ValueError(f"FakeProbe base_bytes must be >= 0, got {base_bytes}.")
        self.device = torch.device("cpu")
        self._capacity = int(capacity_bytes)
        self.sources: list[Callable[[], int]] = list(sources)
        self.base_bytes = int(base_bytes)
        self.strict = strict
        self.history: list[int] | None = [] if record else None

    def add_source(self, source: Callable[[], int]) -> None:
        """Add a callable whose bytes count towards the usage."""
        if not callable(source):
            raise TypeError(f"FakeProbe sources must be callables returning bytes, got {source!r}.")
        self.sources.append(source)

    def capacity_bytes(self) -> int:
        return self._capacity

    def _used_bytes(self) -> int:
        return self.base_bytes + sum(int(s()) for s in self.sources)

    def used_bytes(self) -> int:
        used = super().used_bytes()
        if self.history is not None:
            self.history.append(used)
        if self.strict and used > self._capacity:
            raise torch.OutOfMemoryError(
                f"FakeProbe: {used} bytes in use exceed the fake capacity of "
                f"{self._capacity} bytes"
            )
        return used
