"""The CPU copy engine's share of the cores: an update beside its copies leaves them theirs."""

from __future__ import annotations

import threading

import pytest
import torch

from tightfit.tiers.copy import CopyEngine


@pytest.mark.parametrize(("threads", "copies", "inside"), [(4, 2, 2), (2, 2, 1), (1, 1, 1),
                                                           (3, 0, 3)])
def test_cpu_engine_leaves_copies_in_flight_their_cores(threads, copies, inside
                                                                     ) -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = CopyEngine()
    gate = threading.Event()
    try:
        engine.then(gate.wait)  # a copy in flight until the gate opens
        with engine.beside_copies(copies):
            assert torch.get_num_threads() == inside  # at least one for the update
        assert torch.get_num_threads() == threads
        with pytest.raises(KeyError), engine.beside_copies(copies):
            raise KeyError("a failed update")
        assert torch.get_num_threads() == threads  # restored, raised or not
        gate.set()
        engine.then(lambda: None).result()
        with engine.beside_copies(copies):  # nothing in flight: every thread for the block
            assert torch.get_num_threads() == threads
    finally:
        gate.set()
        engine.close()
        torch.set_num_threads(n)
