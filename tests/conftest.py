"""Shared test configuration: CUDA-only tests skip themselves without a GPU; seeding; threads;
the strict CUDA emulation (``tests/tiers/strict_cuda.py``) as a fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from .tiers.strict_cuda import StrictCuda, install, uninstall


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch intra-op thread for the test (opt in: ``pytestmark =
    pytest.mark.usefixtures("one_thread")``).

    On a shared, loaded 2-core machine intra-op threads over tiny tensors mostly wait for each
    other (a fused AdamW step on 30k elements took 23 ms with 2 threads, 1 ms with one);
    numerics do not change.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def strict_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[StrictCuda]:
    """CUDA as the CPU can run it strictly (``tests/tiers/strict_cuda.py``: asynchronous side
    streams, stream order, a caching allocator that reuses memory at once, backward on its
    own thread, host syncs counted; pinned memory as ``tests/tiers/strict_pinned.py`` pins
    it). The test fails if it leaves a stream-order, allocator or pinning violation (a test
    that expects some asserts and clears them)."""
    emu = install(monkeypatch)
    try:
        yield emu
        emu.synchronize()  # every queued copy ran (and none failed)
    finally:
        uninstall(emu)
    violations = emu.violations + emu.pinned_host.violations
    assert violations == [], "\n".join(violations)
